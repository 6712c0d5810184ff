"""The eager reference engine: determinism, input validation, output shapes; the tests that use
only the Policy protocol (predict, reset_stream, history_offset_s) run twice: on PolicyEngine in
this process, and through the engine process's boundary (ros.engine_process.EngineProcess: the
typed messages, the shared-memory frames, the worker), as the node runs it, without DDS."""
import os
import signal

import numpy as np
import pytest
import torch

from vla_node.ros.engine_process import EngineError, EngineProcess
from vla_node.ros.engine_protocol import WorkerOptions
from vla_node.runtime import EngineConfig, Observation, PolicyEngine
from vla_node.runtime.types import Policy

START_TIMEOUT_S = 300.0   # a failure bound: loading the tiny model takes seconds


def start_process(config: EngineConfig) -> EngineProcess:
    process = EngineProcess(config, WorkerOptions("eager", threads=0, nice=0))
    process.start(START_TIMEOUT_S, lambda m: None, lambda m: None, lambda: None)
    return process


@pytest.fixture(scope="module")
def reference():
    return PolicyEngine(EngineConfig(seed=0))


@pytest.fixture(scope="module", params=["in-process", "engine-process"])
def engine(request, reference):
    """A Policy with seed 0: the reference itself, or an engine process."""
    if request.param == "in-process":
        yield reference
        return
    process = start_process(EngineConfig(seed=0))
    yield process
    process.close()


def test_chunk_shape_and_timings(engine, reference):
    assert isinstance(engine, Policy)
    chunk = engine.predict(reference.dummy_observation())
    assert chunk.actions.shape == (16, 8) and chunk.actions.dtype == np.float32
    assert np.isfinite(chunk.actions).all()
    assert set(chunk.timings) == {"preprocess", "vision", "llm", "action", "total"}
    assert engine.history_offset_s == reference.history_offset_s


def test_a_known_prefix_starts_the_chunk_through_either_boundary(engine, reference):
    """Observation.known_actions (robot units) crosses the process boundary as data: the chunk's
    first actions are they, exactly in the model's normalised units, to float32 round-off in
    robot units; the next query without them is sampled freely again."""
    obs = reference.dummy_observation()
    obs.known_actions = engine.predict(obs).actions[:4] + 0.05
    chunk = engine.predict(obs)
    known = reference.model.normalize_actions(torch.as_tensor(obs.known_actions)).numpy()
    assert np.array_equal(chunk.normalized[:4], known)
    assert np.abs(chunk.actions[:4] - obs.known_actions).max() < 2e-6
    obs.known_actions = None
    assert not np.allclose(engine.predict(obs).actions[:4], chunk.actions[:4])


def test_the_engine_process_predicts_what_the_engine_does():
    """Same seed, same observations: the same actions through the process boundary, query after
    query (the noise stream), and frame ids carried across it (the stream reset keeps them apart).
    A reset restarts the noise stream on both sides: the next chunk is the first one again, so an
    episode's chunks do not depend on the episodes before it."""
    local, process = PolicyEngine(EngineConfig(seed=4)), start_process(EngineConfig(seed=4))
    local.warmup()   # as the worker does before it serves
    try:
        obs = local.dummy_observation()
        obs.frame_ids = [("exo", 1), ("wrist", 1), ("exo", 2), ("wrist", 2)]
        chunks = []
        for _ in range(2):
            a, b = local.predict(obs), process.predict(obs)
            assert np.array_equal(a.actions, b.actions) and np.array_equal(a.normalized, b.normalized)
            chunks.append(a.actions)
        assert not np.array_equal(chunks[0], chunks[1])    # the second query drew new noise
        local.reset_stream()
        process.reset_stream()
        a, b = local.predict(obs), process.predict(obs)
        assert np.array_equal(a.actions, b.actions) and np.array_equal(a.actions, chunks[0])
    finally:
        process.close()


def test_reconfigure_answers_with_the_config_in_effect_or_the_error_with_its_traceback():
    process = start_process(EngineConfig(seed=0))
    try:
        process.reconfigure({"action_cache": "3-6:2"})
        answer = poll_answer(process)
        assert answer.error == "" and answer.config.action_cache == "3-6:2"
        assert process.config.action_cache == "3-6:2"     # the engine's answer is the one copy
        process.reconfigure({"action_cache": "5:7"})
        answer = poll_answer(process)
        assert "can only reuse an earlier step" in answer.error and "Traceback" in answer.trace
        assert answer.config.action_cache == "3-6:2" == process.config.action_cache
        process.reconfigure({"camera_height": 10})
        answer = poll_answer(process)
        assert "cannot change while the engine runs" in answer.error
    finally:
        process.close()
    with pytest.raises(ValueError, match="cannot change while the engine runs"):
        PolicyEngine(EngineConfig()).reconfigure({"seed": 3})


def poll_answer(process: EngineProcess):
    answer = process.poll(START_TIMEOUT_S)
    assert answer is not None, "no answer from the engine process"
    return answer


def test_a_failed_start_arrives_with_the_workers_traceback():
    process = EngineProcess(EngineConfig(checkpoint="/nonexistent/checkpoint"), WorkerOptions("eager", 0, 0))
    with pytest.raises(EngineError) as failed:
        process.start(START_TIMEOUT_S, lambda m: None, lambda m: None, lambda: None)
    process.close()
    assert "/nonexistent/checkpoint" in str(failed.value) and "\n" not in str(failed.value)
    assert "Traceback (most recent call last)" in failed.value.trace


def test_a_killed_worker_is_named_by_its_exit_code_whether_a_send_or_a_receive_finds_it():
    """SIGKILL breaks the pipe: the next send (a submit, a reset, a reconfigure) fails before any
    poll sees the exit, and says the same thing a poll would (the node reports either alike)."""
    process = start_process(EngineConfig(seed=0))
    try:
        os.kill(process.info.pid, signal.SIGKILL)
        os.waitid(os.P_PID, process.info.pid, os.WEXITED | os.WNOWAIT)   # all its threads gone; not reaped
        for send in (process.reset_stream, lambda: process.reconfigure({"action_cache": "3-6:2"})):
            with pytest.raises(EngineError, match=r"^engine process exited \(code -9\)$"):
                send()
        with pytest.raises(EngineError, match=r"^engine process exited \(code -9\)$"):
            process.poll(START_TIMEOUT_S)
    finally:
        process.close()


@pytest.mark.parametrize("mode", ["eager", "ctxkv"])   # the reference loop; the static runner's buckets
def test_an_engine_giving_non_finite_actions_fails_its_warm_up_in_one_line(mode):
    """A feature broken on the device (the removed split attention once returned NaN in fp32 on CUDA)
    stops the start instead of having every chunk refused, and says what to try."""
    engine = PolicyEngine(EngineConfig.for_mode(mode))
    engine.model.expert.action_out.register_forward_hook(lambda module, inputs, out: out * float("nan"))
    with pytest.raises(RuntimeError, match="warm-up gave non-finite actions") as failed:
        engine.warmup()
    assert "float32 on cpu" in str(failed.value) and "\n" not in str(failed.value)


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


def test_given_noise_is_used(reference):
    engine = reference
    obs = engine.dummy_observation()
    noise = torch.randn(1, 16, 8)
    assert np.array_equal(engine.predict(obs, noise=noise).actions, engine.predict(obs, noise=noise).actions)


def test_instruction_and_images_change_the_actions(reference):
    engine = reference
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
    (lambda o: setattr(o, "known_actions", np.zeros((17, 8), np.float32)), r"known_actions must be \[k, 8\] with "
                                                                           r"1 <= k <= 16 .*got shape \(17, 8\)"),
    (lambda o: setattr(o, "known_actions", np.zeros((0, 8), np.float32)), "known_actions must be"),
    (lambda o: setattr(o, "known_actions", np.full((2, 8), np.inf, np.float32)), "known_actions has non-finite"),
])
def test_bad_inputs_are_rejected_clearly(engine, reference, mutate, message):
    obs = reference.dummy_observation()
    obs.images = list(obs.images)
    mutate(obs)
    with pytest.raises(ValueError, match=message):
        engine.predict(obs)
