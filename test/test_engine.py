"""The eager reference engine: determinism, input validation, output shapes."""
import numpy as np
import pytest
import torch

from vla_node.runtime import EngineConfig, Observation, PolicyEngine


@pytest.fixture(scope="module")
def engine():
    return PolicyEngine(EngineConfig(seed=0))


def test_chunk_shape_and_timings(engine):
    chunk = engine.predict(engine.dummy_observation())
    assert chunk.actions.shape == (16, 8) and chunk.actions.dtype == np.float32
    assert np.isfinite(chunk.actions).all()
    assert set(chunk.timings) == {"preprocess", "vision", "llm", "action", "total"}


def test_deterministic_for_a_seed():
    a, b = PolicyEngine(EngineConfig(seed=5)), PolicyEngine(EngineConfig(seed=5))
    obs = a.dummy_observation()
    for _ in range(3):  # the noise stream, not just the first draw
        assert np.array_equal(a.predict(obs).actions, b.predict(obs).actions)
    c = PolicyEngine(EngineConfig(seed=6))
    assert not np.array_equal(c.predict(obs).actions, PolicyEngine(EngineConfig(seed=5)).predict(obs).actions)


def test_noise_stream_is_the_same_in_every_mode_after_warmup():
    eager = PolicyEngine(EngineConfig.for_mode("eager", seed=3))
    static = PolicyEngine(EngineConfig.for_mode("ctxkv", seed=3))
    eager.warmup()
    static.warmup()
    assert torch.equal(eager.draw_noise(), static.draw_noise())


def test_given_noise_is_used(engine):
    obs = engine.dummy_observation()
    noise = torch.randn(1, 16, 8)
    assert np.array_equal(engine.predict(obs, noise=noise).actions, engine.predict(obs, noise=noise).actions)


def test_instruction_and_images_change_the_actions(engine):
    obs = engine.dummy_observation()
    noise = torch.randn(1, 16, 8)
    base = engine.predict(obs, noise=noise).normalized
    other_text = Observation(images=obs.images, state=obs.state, instruction="open the drawer")
    assert not np.allclose(engine.predict(other_text, noise=noise).normalized, base)
    other_images = Observation(images=[255 - im for im in obs.images], state=obs.state, instruction=obs.instruction)
    assert not np.allclose(engine.predict(other_images, noise=noise).normalized, base)


@pytest.mark.parametrize("mutate, message", [
    (lambda o: o.images.__setitem__(0, np.zeros((240, 320, 3), np.uint8)), r"image 0: expected shape \(480, 640, 3\)"),
    (lambda o: o.images.__setitem__(1, np.zeros((480, 640, 3), np.float32)), "image 1: expected a uint8"),
    (lambda o: o.images.pop(), "expected 4 images"),
    (lambda o: setattr(o, "state", np.zeros(7, np.float32)), "state must have 8 values"),
    (lambda o: setattr(o, "state", np.full(8, np.nan, np.float32)), "non-finite"),
    (lambda o: setattr(o, "instruction", "   "), "instruction is empty"),
    (lambda o: setattr(o, "instruction", "pick up the red cup " * 30), "budget is 96"),
])
def test_bad_inputs_are_rejected_clearly(engine, mutate, message):
    obs = engine.dummy_observation()
    obs.images = list(obs.images)
    mutate(obs)
    with pytest.raises(ValueError, match=message):
        engine.predict(obs)
