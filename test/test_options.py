"""Opt-in options: streaming KV across windows, action caching, fp8. Each changes the numbers;
these tests pin down the bookkeeping that must be exact and the bounds that must hold."""
import numpy as np
import pytest
import torch

from vla_node.model.layers import apply_rope, rope_tables
from vla_node.runtime import LAYOUTS, EngineConfig, Observation, PolicyEngine
from vla_node.runtime.action_cache import FlowSchedule
from vla_node.runtime.fp8 import E4M3_MAX, Fp8Linear, dequantize, quantize

LAYOUT = LAYOUTS["droid"]


def window_stream(n: int, seed: int = 0, instruction: str = "pick up the red cup"):
    """Windows of frames t-8 and t for both cameras, every 8 frames: each shares a frame time with the last."""
    rng = np.random.default_rng(seed)
    frames = {}
    for step in range(n):
        ids = [(cam, t) for t in (step * LAYOUT.stride, (step + 1) * LAYOUT.stride) for cam in LAYOUT.cameras]
        for fid in ids:
            frames.setdefault(fid, rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
        yield Observation(images=[frames[f] for f in ids], state=rng.uniform(-1, 1, 8).astype(np.float32),
                          instruction=instruction, frame_ids=ids)


def test_rope_rotation_composes():
    """Shifting a cached key by -d positions equals computing it at the new position."""
    k = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    pos = torch.arange(40, 45)
    cos, sin = rope_tables(16, pos, 10_000.0)
    dcos, dsin = rope_tables(16, torch.tensor([-23]), 10_000.0)
    ncos, nsin = rope_tables(16, pos - 23, 10_000.0)
    assert torch.allclose(apply_rope(apply_rope(k, cos, sin), dcos, dsin), apply_rope(k, ncos, nsin), atol=1e-5)


def test_streaming_slots_get_full_recompute_positions():
    """After a slide, every cached key/value of a surviving frame sits at the slot a full
    recompute of the new window gives it, rotated to that position. Layer 0 sees only the
    token itself, so there the streamed cache must equal a full recompute's (labels aside)."""
    cfg = dict(vision_cache=True)
    streamed = PolicyEngine(EngineConfig.for_mode("ctxkv", streaming_kv=True, **cfg))
    full = PolicyEngine(EngineConfig.for_mode("ctxkv", streaming_kv=True, **cfg))  # its first query: a full prefill
    w1, w2 = list(window_stream(2))
    streamed.predict(w1)
    streamed.predict(w2)
    assert streamed.static.stream_steps == 1
    full.predict(w2)
    prompt = streamed.prompts.build(2, 2, w2.instruction)
    b = streamed.static.bucket(LAYOUT)
    # Image tokens (patches, image start/end) and the instruction; "Image k" labels differ by design.
    real = torch.zeros(b.length, dtype=torch.bool)
    real[:len(prompt)] = torch.tensor(prompt.image_token)
    real[prompt.instruction_start:len(prompt)] = True
    real[0] = True  # BOS
    layer_s, layer_f = streamed.model.llm.layers[0].attn.cache, full.model.llm.layers[0].attn.cache
    assert torch.allclose(layer_s.k[0, :, real], layer_f.k[0, :, real], atol=1e-5)
    assert torch.allclose(layer_s.v[0, :, real], layer_f.v[0, :, real], atol=1e-6)
    # Deeper layers differ only in the surviving frames (stale context), not in the prefix.
    deep_s, deep_f = streamed.model.llm.layers[-1].attn.cache, full.model.llm.layers[-1].attn.cache
    assert torch.allclose(deep_s.k[0, :, :1], deep_f.k[0, :, :1], atol=1e-5)


def test_streaming_off_gives_independent_full_query_actions():
    streamed = PolicyEngine(EngineConfig.for_mode("ctxkv", vision_cache=True))
    for obs in window_stream(4):
        noise = torch.randn(1, 16, 8)
        fresh = PolicyEngine(EngineConfig.for_mode("ctxkv"))  # nothing carried over
        a = streamed.predict(obs, noise=noise).normalized
        b = fresh.predict(Observation(obs.images, obs.state, obs.instruction), noise=noise).normalized
        assert np.abs(a - b).max() < 1e-5  # exact up to fp32 rounding of the batch size


def test_streaming_resets_on_a_jump_and_on_request():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", vision_cache=True, streaming_kv=True))
    windows = list(window_stream(4))
    engine.predict(windows[0])
    engine.predict(windows[2])  # not a one-frame slide: full prefill
    assert engine.static.stream_steps == 0
    engine.predict(windows[3])
    assert engine.static.stream_steps == 1
    engine.reset_stream()
    engine.predict(windows[3])
    assert engine.static.stream_steps == 1


@pytest.mark.parametrize("spec, steps, calls", [("", 10, 10), ("flashdrive", 8, 4), ("3-6:2", 8, 4),
                                                 ("4:3,5:3", 6, 4), ("1-9:0", 10, 1)])
def test_action_cache_runs_the_expert_exactly_as_scheduled(spec, steps, calls):
    for mode in ("eager", "ctxkv"):
        engine = PolicyEngine(EngineConfig.for_mode(mode, flow_steps=steps, action_cache=spec))
        count = []
        velocity = engine.model.expert.velocity
        engine.model.expert.velocity = lambda *a, **k: (count.append(1), velocity(*a, **k))[1]
        engine.predict(engine.dummy_observation())
        assert len(count) == calls, mode
        assert FlowSchedule.parse(spec, steps).expert_calls == calls


def test_action_cache_constant_field_is_unchanged():
    """Reusing a velocity is exact when the field does not change: the flow ends at the same point."""
    from vla_node.model.action_expert import euler

    v = torch.randn(1, 16, 8)
    noise = torch.randn(1, 16, 8)
    assert torch.allclose(euler(lambda x, i: v, noise, 8, FlowSchedule.parse("flashdrive", 8).reuse_map),
                          euler(lambda x, i: v, noise, 8), atol=1e-6)


def test_adaptive_action_cache_skips_steps_and_can_change_at_runtime():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", action_cache="adaptive:0.9"))
    obs = engine.dummy_observation()
    noise = torch.randn(1, 16, 8)
    cached = engine.predict(obs, noise=noise).normalized
    assert 2 <= engine.static.expert_calls < 10
    engine.set_flow(action_cache="")
    engine.static.expert_calls = 0
    plain = engine.predict(obs, noise=noise).normalized
    assert engine.static.expert_calls == 10
    reference = PolicyEngine(EngineConfig.for_mode("ctxkv")).predict(obs, noise=noise).normalized
    assert np.array_equal(plain, reference)
    assert not np.array_equal(cached, plain)


@pytest.mark.parametrize("spec, steps, message", [
    ("flashdrive", 10, "defined for 8 flow steps"), ("3:3", 8, "earlier step"), ("9:2", 8, "outside 0..7"),
    ("3:2,4:3", 8, "itself reused"), ("3:2,3:1", 8, "given twice"), ("adaptive:1.5", 8, r"in \(0, 1\)"),
    ("adaptive:x", 8, "threshold"), ("three:two", 8, "cannot read"), ("", 0, "flow steps must be >= 1"),
])
def test_invalid_schedules_are_rejected(spec, steps, message):
    with pytest.raises(ValueError, match=message):
        FlowSchedule.parse(spec, steps)


def test_invalid_set_flow_changes_nothing():
    engine = PolicyEngine(EngineConfig.for_mode("ctxkv", flow_steps=8, action_cache="flashdrive"))
    with pytest.raises(ValueError):
        engine.set_flow(steps=10)  # flashdrive is an 8-step schedule
    assert engine.flow_steps == 8 and engine.schedule.expert_calls == 4
    with pytest.raises(ValueError, match="adaptive action cache needs static_shapes"):
        PolicyEngine(EngineConfig(action_cache="adaptive:0.1"))


@pytest.mark.parametrize("rowwise", [True, False])
def test_fp8_round_trip_bounds(rowwise):
    x = torch.randn(64, 256) * torch.logspace(-2, 2, 64)[:, None]
    q, scale = quantize(x, rowwise)
    assert q.dtype == torch.float8_e4m3fn and float(q.float().abs().max()) <= E4M3_MAX
    err = (dequantize(q, scale) - x).abs()
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4 of each value above the subnormals.
    bound = x.abs() * 2.0 ** -4 + scale * 2.0 ** -9
    assert bool((err <= bound).all())


def test_fp8_linear_matches_dequantized_reference():
    lin = torch.nn.Linear(64, 96, bias=False)
    fp8 = Fp8Linear.from_linear(lin, "rowwise")
    x = torch.randn(5, 64)
    xq, xs = quantize(x, True)
    ref = dequantize(xq, xs) @ dequantize(fp8.weight_fp8, fp8.weight_scale.reshape(-1, 1)).T
    assert torch.allclose(fp8(x), ref, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        assert float((fp8(x) - lin(x)).norm() / lin(x).norm()) < 0.05


def test_fp8_engine_halves_llm_weight_bytes_and_stays_close():
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv"))
    fp8 = PolicyEngine(EngineConfig.for_mode("ctxkv", fp8="tensorwise"))
    llm_fp32 = sum(p.numel() * 4 for n, p in plain.model.llm.named_parameters() if "embed" not in n)
    assert fp8.stats.fp8_weight_bytes < llm_fp32 / 3.9  # 1 byte per weight instead of 4
    obs = plain.dummy_observation()
    noise = torch.randn(1, 16, 8)
    a, b = plain.predict(obs, noise=noise).normalized, fp8.predict(obs, noise=noise).normalized
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.1


# -- on the GPU: the options under compile + CUDA graphs ----------------------------------------


def gpu(mode: str, **kw) -> PolicyEngine:
    engine = PolicyEngine(EngineConfig.for_mode(mode, device="cuda", dtype="bfloat16", **kw))
    if engine.config.static_shapes:
        engine.warmup()
    return engine


@pytest.mark.cuda
def test_gpu_streaming_under_graphs_matches_eager_execution_of_the_same_option():
    graphs = gpu("fast", streaming_kv=True)
    plain = gpu("ctxkv", vision_cache=True, streaming_kv=True)
    for obs in window_stream(5):
        noise = torch.randn(1, 16, 8, device="cuda")
        a, b = graphs.predict(obs, noise=noise).normalized, plain.predict(obs, noise=noise).normalized
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < 1e-2
    assert graphs.static.stream_steps == plain.static.stream_steps == 4


@pytest.mark.cuda
@pytest.mark.parametrize("scaling", ["rowwise", "tensorwise"])
def test_gpu_fp8_under_graphs_stays_close(scaling):
    fp8 = gpu("fast", fp8=scaling)
    ref = gpu("fast")
    obs = ref.dummy_observation()
    noise = torch.randn(1, 16, 8, device="cuda")
    a, b = ref.predict(obs, noise=noise).normalized, fp8.predict(obs, noise=noise).normalized
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.1


@pytest.mark.cuda
def test_gpu_action_cache_schedules_under_graphs():
    engine = gpu("fast", flow_steps=8, action_cache="flashdrive")
    obs = engine.dummy_observation()
    noise = torch.randn(1, 16, 8, device="cuda")
    first = engine.predict(obs, noise=noise).normalized
    assert np.array_equal(engine.predict(obs, noise=noise).normalized, first)
    engine.set_flow(action_cache="adaptive:0.5")  # re-captured as per-step graphs
    adaptive = engine.predict(obs, noise=noise).normalized
    engine.set_flow(action_cache="")
    plain = engine.predict(obs, noise=noise).normalized
    reference = gpu("ctxkv", flow_steps=8).predict(obs, noise=noise).normalized
    assert np.linalg.norm(plain - reference) / np.linalg.norm(reference) < 1e-2
    assert np.isfinite(adaptive).all() and engine.static.recompiles() == 0
