"""Batched queries (PolicyEngine.predict_batch): each entry of a batch gets what predict() gives it
alone, to float32 rounding (the batch changes the order of sums, nothing else): its own noise or
noise generator's draw, instruction (padded to the batch's longest on the eager path), state and
known actions; a batch of 3 runs in the static bucket of 4, its padding row dropped. What cannot
share a query is kept apart (batch_key), and an observation the engine cannot use is refused
before anything runs. The engine server's batches are test_engine_server.py."""
import numpy as np
import pytest
import torch

from vla_node.runtime import LAYOUTS, EngineConfig, PolicyEngine

TOLERANCE = 1e-5   # normalised units: the reorderings of a batched matmul (seen: 5e-7)


def observations(engine: PolicyEngine, n: int = 3):
    """Windows of different robots: other frames, states, instruction lengths; the last one with
    a known prefix (the inpaint hand-over), the others without."""
    obs = [engine.dummy_observation(seed=j) for j in range(n)]
    for j, o in enumerate(obs):
        o.instruction = ["pick up the red cup", "open the drawer",
                         "put the marker in the bowl and close the lid slowly"][j % 3]
        o.frame_ids = [(j, camera, t) for t in range(2) for camera in engine.layout.cameras]
    obs[-1].known_actions = np.full((3, 8), 0.1, np.float32)
    return obs


@pytest.mark.parametrize("mode, overrides", [
    ("eager", {}),                                       # the reference: padded prompts, per-entry masks
    ("ctxkv", dict(fused=True, vision_cache=True)),      # static buckets per batch size, the cached frames
    ("ctxkv", dict(action_cache="6-7:5")),               # a static action-cache schedule batches too
], ids=["eager", "static-vision-cache", "action-cache"])
def test_each_entry_of_a_batch_gets_its_actions_alone(mode, overrides):
    engine = PolicyEngine(EngineConfig.for_mode(mode, max_batch=4, **overrides))
    obs = observations(engine)
    noise = torch.randn((3, 16, 8), generator=torch.Generator().manual_seed(0))
    alone = [engine.predict(o, noise=noise[j:j + 1]) for j, o in enumerate(obs)]
    for n in (2, 3):   # 3: the bucket of 4, its padding row repeating the last entry
        batch = engine.predict_batch(obs[:n], noise=noise[:n])
        assert len(batch) == n
        for want, got in zip(alone, batch):
            assert np.abs(got.normalized - want.normalized).max() < TOLERANCE
            assert got.stamp == want.stamp and "total" in got.timings
    known = engine.model.normalize_actions(torch.as_tensor(obs[-1].known_actions)).numpy()
    assert np.array_equal(batch[-1].normalized[:3], known)   # the known prefix, exactly
    if engine.static is not None:
        assert {size for _, size, _ in engine.static.buckets} == {1, 2, 4}


def test_each_entry_draws_its_noise_from_its_own_generator():
    """A robot's n-th query gets the n-th draw of its own stream, batched or not."""
    engine = PolicyEngine(EngineConfig(max_batch=2))
    obs = observations(engine, 2)
    streams = lambda: [torch.Generator().manual_seed(s) for s in (11, 12)]  # noqa: E731
    alone_streams, batch_streams = streams(), streams()
    for _ in range(2):
        alone = [engine.predict(o, generator=g) for o, g in zip(obs, alone_streams)]
        batch = engine.predict_batch(obs, generators=batch_streams)
        for want, got in zip(alone, batch):
            assert np.abs(got.normalized - want.normalized).max() < TOLERANCE
    assert not np.allclose(batch[0].normalized, batch[1].normalized)


def test_what_cannot_share_a_query_is_kept_apart_and_bad_input_runs_nothing():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", max_batch=2))
    obs = observations(engine, 2)
    start = engine.dummy_observation(engine.layout.with_frames(1))   # an episode's start: another bucket
    assert engine.batch_key(obs[0]) == engine.batch_key(obs[1]) != engine.batch_key(start)
    assert engine.batch_key(obs[0], options={"action_cache": "6-7:5"}) != engine.batch_key(obs[0])
    assert engine.batch_key(obs[0], options={"action_cache": "adaptive:0.5"}) is None   # one reuse decision
    typed = engine.dummy_observation()
    typed.instruction = "pick up the <im_patch> cup"    # its prefill mask is its own
    assert engine.batch_key(typed) is None
    with pytest.raises(ValueError, match="one layout"):
        engine.predict_batch([obs[0], start])
    with pytest.raises(ValueError, match="1 to 2 observations"):
        engine.predict_batch(obs + obs[:1])
    bad = engine.dummy_observation()
    bad.state = np.zeros(7, np.float32)
    queries = engine.stats.queries
    with pytest.raises(ValueError, match="state must have 8 values"):
        engine.batch_key(bad)
    with pytest.raises(ValueError, match="state must have 8 values"):
        engine.predict_batch([obs[0], bad])
    assert engine.stats.queries == queries
    streaming = PolicyEngine(EngineConfig.for_mode("ctxkv", vision_cache=True, streaming_kv=True, max_batch=8))
    assert streaming.max_batch == 1 and streaming.batch_key(obs[0]) is None   # one robot's KV cache
    assert {size for _, size in streaming.static.buckets} <= {1}


def test_max_batch_is_a_batch_size_and_defaults_to_one():
    assert EngineConfig().max_batch == 1
    with pytest.raises(ValueError, match=r"max_batch must be one of \(1, 2, 4, 8\)"):
        EngineConfig(max_batch=3)
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", layout=LAYOUTS["droid"]))
    with pytest.raises(ValueError, match="1 to 1 observations"):
        engine.predict_batch(observations(engine, 2))


@pytest.mark.cuda
def test_fast_batches_replay_graphs_captured_at_warm_up_and_match_single_queries():
    """On the GPU (not run in CI): `fast` with batches of 2 and 3 (the graphs of 4) replays what
    warm-up captured, nothing compiled or captured after it, each entry within bf16 noise of its
    query alone."""
    engine = PolicyEngine(EngineConfig.for_mode("fast", device="cuda", dtype="bfloat16", max_batch=4))
    engine.warmup()
    captures = engine.stats.graph_captures
    obs = observations(engine)
    noise = torch.randn((3, 16, 8), generator=torch.Generator().manual_seed(0)).cuda()
    alone = [engine.predict(o, noise=noise[j:j + 1]).normalized for j, o in enumerate(obs)]
    for n in (2, 3):
        for want, got in zip(alone, engine.predict_batch(obs[:n], noise=noise[:n])):
            assert np.linalg.norm(got.normalized - want) / np.linalg.norm(want) < 1e-2
    assert engine.static.graph_captures == captures and engine.static.recompiles() == 0
