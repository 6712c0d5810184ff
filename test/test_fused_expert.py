"""The fused flow-loop kernel (runtime/fused_expert.py, kernels/expert_flow.py) against the
model's own loop: on the CPU through TRITON_INTERPRET=1 (set by conftest.py; every phase one
launch, the order the persistent kernel runs them in), the full-size kernels compiled for sm_90
without a GPU, and on the GPU (marked cuda) the persistent kernel itself: graph replays,
batches, its barriers.

Tolerances: fp32 1e-5 relative. bf16 models: within bf16 noise, i.e. no farther from the fp32
model than the eager bf16 expert is (~7e-3 on the tiny model; under the interpreter the dots
run in fp32, on the GPU in bf16)."""
import copy
import dataclasses
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from vla_node.model import get_preset, init_random_
from vla_node.model.action_expert import ActionExpert, KnownActions, euler, flow_times
from vla_node.runtime import EngineConfig, PolicyEngine, fused_expert
from vla_node.runtime.fused_expert import FusedExpert, Tiling
from vla_node.runtime.graphs import capture

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5 if DEVICE == "cpu" else 2e-3  # tf32 in the GPU's few-query attention dots
# Small tiles so the tiny shapes take every path: several x tiles and K chunks, K splits of fc2,
# key splits of the cross-attention, more items than programs.
SMALL = Tiling(programs=16, x_tile=16, block_k=32, fc2_block_k=16, block_keys=16)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def expert_inputs(preset: str, entries: int, context: int, seed: int = 0, horizon: int = 0):
    """A random expert (fp32) and one query's context K/V (with padding masked), noise; horizon:
    the preset's, or this many actions."""
    cfg = get_preset(preset)
    if horizon:
        cfg = dataclasses.replace(cfg, action=dataclasses.replace(cfg.action, horizon=horizon))
    with torch.device(DEVICE):
        e = init_random_(ActionExpert(cfg).eval().requires_grad_(False), seed=seed)
    g = torch.Generator().manual_seed(seed)
    hidden = [torch.randn(entries, context, cfg.llm.dim, generator=g).to(DEVICE) for _ in e.blocks]
    state = torch.randn(entries, e.cfg.state_dim, generator=g).to(DEVICE)
    mask = (torch.rand(entries, 1, 1, context + 1, generator=g) > 0.3).to(DEVICE)
    mask[..., -1] = True  # the state token
    noise = torch.randn(entries, e.cfg.horizon, e.cfg.action_dim, generator=g).to(DEVICE)
    with torch.no_grad():
        kv = e.context_kv(hidden, state)
    return e, kv, mask, noise


def mod_table(expert, steps: int) -> list:
    with torch.no_grad():
        return [expert.modulations(torch.full((1,), t, device=DEVICE)) for t in flow_times(steps)]


def reference_flow(expert, table, kv, mask, noise, reuse=None, known=None):
    """The runner's Euler loop over the eager expert (runtime/static.py)."""
    with torch.no_grad():
        return euler(lambda x, i: expert.velocity(x.to(expert.action_pos.dtype), table[i], kv, mask).float(),
                     noise, len(table), reuse, known)


def known_prefix(noise: torch.Tensor, k: int, seed: int = 1) -> KnownActions:
    """Random normalised values for the rows of noise [B, H, A], the first k of them known."""
    values = torch.randn(noise.shape, generator=torch.Generator().manual_seed(seed)).to(noise.device)
    return KnownActions(values, (torch.arange(noise.shape[1], device=noise.device) < k)[None, :, None])


@pytest.fixture(scope="module")
def tiny():
    return expert_inputs("tiny", 1, 40)


@pytest.mark.parametrize("tiling", [
    Tiling(), SMALL, Tiling(programs=3, x_tile=32, block_keys=16),
    Tiling(programs=32, block_keys=16),   # key splits of 8 keys: a key chunk reaches into the next split
])
def test_fused_velocity_matches_expert(tiny, tiling):
    expert, kv, mask, noise = tiny
    (mods,) = mod_table(expert, 1)
    with torch.no_grad():
        ref = expert.velocity(noise, mods, kv, mask)
        out = FusedExpert(expert, tiling=tiling).velocity(noise, mods, kv, mask)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) < TOL


@pytest.mark.parametrize("preset, entries, steps, reuse, horizon", [
    ("tiny", 1, 2, None, 0),
    ("tiny", 1, 4, {2: 1, 3: 1}, 0),    # action caching: steps 2 and 3 take step 1's velocity
    ("tiny", 3, 2, None, 0),            # three observations in one batch, each with its own mask
    ("tiny", 3, 1, None, 10),           # entries of 10 rows in tiles of 16: a tile's last rows are the next entry's
    ("sim", 1, 1, None, 0),             # the shipped policy's shapes: horizon 32, 14 joints, head_dim 48
])
def test_fused_flow_matches_the_reference_loop(preset, entries, steps, reuse, horizon):
    expert, kv, mask, noise = expert_inputs(preset, entries, 37, horizon=horizon)
    table = mod_table(expert, steps)
    fused = FusedExpert(expert, tiling=SMALL)
    with torch.no_grad():
        out = fused.flow(noise, fused.schedule(table, reuse), kv, mask)
    assert out.shape == noise.shape and out.dtype == torch.float32
    assert rel(out, reference_flow(expert, table, kv, mask, noise, reuse)) < TOL


def test_fused_flow_is_deterministic_and_leaves_counters_zero(tiny):
    expert, kv, mask, noise = tiny
    fused = FusedExpert(expert, tiling=SMALL)
    inputs = fused.schedule(mod_table(expert, 1))
    first = fused.flow(noise, inputs, kv, mask).clone()
    assert torch.equal(fused.flow(noise, inputs, kv, mask), first)  # parts are summed in a fixed order
    (buffers,) = fused._buffers.values()
    assert not buffers.counter.any() and not fused.barrier_timed_out()


def test_inpainting_on_the_kernel_keeps_the_known_rows_exactly_and_matches_the_reference_loop(tiny):
    """A known prefix runs the loop one flow step at a time (here each step's phases; on the GPU one
    persistent launch per step), the known rows inpainted between the steps as euler() does: they
    end on the known values bit for bit, and a reused step (action caching) still starts a step."""
    expert, kv, mask, noise = tiny
    table, reuse = mod_table(expert, 3), {2: 1}
    fused = FusedExpert(expert, tiling=SMALL)
    inputs = fused.schedule(table, reuse)
    known = known_prefix(noise, 5)
    with torch.no_grad():
        out = fused.flow(noise, inputs, kv, mask, known)
    assert torch.equal(out[:, :5], known.values[:, :5])
    assert rel(out, reference_flow(expert, table, kv, mask, noise, reuse, known)) < TOL
    with pytest.raises(ValueError, match="trace"):
        FusedExpert(expert, tiling=Tiling(trace=True)).flow(noise, inputs, kv, mask, known)


def test_fused_velocity_of_bf16_expert_is_within_bf16_noise(tiny):
    expert, kv, mask, noise = tiny
    expert16 = copy.deepcopy(expert).to(torch.bfloat16)
    (mods,), (mods16,) = mod_table(expert, 1), mod_table(expert16, 1)
    kv16 = [(k.bfloat16(), v.bfloat16()) for k, v in kv]
    with torch.no_grad():
        ref = expert.velocity(noise, mods, kv, mask)
        eager16 = expert16.velocity(noise.bfloat16(), mods16, kv16, mask)
        fused16 = FusedExpert(expert16, tiling=SMALL).velocity(noise.bfloat16(), mods16, kv16, mask)
    assert fused16.dtype == torch.bfloat16
    assert rel(eager16, ref) < 2e-2
    assert rel(fused16, ref) < 1.5 * rel(eager16, ref)


def dequantized_copy(expert, fused):
    """The expert with every block linear replaced by the fused expert's dequantised e4m3 weights."""
    out = copy.deepcopy(expert)
    for j, blk in enumerate(out.blocks):
        for name, w in zip(blk.self_qkv.names, fused.qkv.dequantized(j).split(blk.self_qkv.sizes)):
            getattr(blk.self_qkv, name).weight.copy_(w)
        for name in ("self_out", "cross_q", "cross_out", "fc1", "fc2"):
            getattr(blk, name).weight.copy_(getattr(fused, name).dequantized(j))
    return out


def test_fp8_velocity_matches_its_dequantized_expert(tiny):
    expert, kv, mask, noise = tiny
    fused = FusedExpert(expert, fp8=True, tiling=SMALL)
    assert fused.fc1.weight.dtype == torch.float8_e4m3fn
    reference = dequantized_copy(expert, fused)
    (mods,) = mod_table(expert, 1)
    with torch.no_grad():
        out = fused.velocity(noise, mods, kv, mask)
        ref = reference.velocity(noise, mods, kv, mask)
        plain = expert.velocity(noise, mods, kv, mask)
    assert rel(out, ref) < TOL
    assert 1e-4 < rel(out, plain) < 5e-2  # e4m3 really changes the numbers, by a little


def test_fused_velocity_traces_as_one_opaque_op(tiny):
    expert, kv, mask, noise = tiny
    (mods,) = mod_table(expert, 1)
    fused = FusedExpert(expert)
    compiled = torch.compile(lambda x: fused.velocity(x, mods, kv, mask), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(noise), fused.velocity(noise, mods, kv, mask))


def test_fused_expert_rejects_more_than_128_rows(tiny):
    expert, kv, mask, _ = tiny
    (mods,) = mod_table(expert, 1)
    kv9 = [(k.expand(9, -1, -1, -1), v.expand(9, -1, -1, -1)) for k, v in kv]
    with pytest.raises(ValueError, match="at most 128 rows"):
        FusedExpert(expert).velocity(torch.zeros(9, 16, 8, device=DEVICE), mods, kv9)


def test_batches_run_persistent_and_long_horizons_one_launch_per_phase(tiny, monkeypatch):
    """Every dot takes one entry's rows, so any batch runs the persistent loop; a horizon over
    PERSISTENT_MAX_TOKENS would make tiles that compile to wgmma, which failed in that loop on
    the H200, so it takes the per-phase launches."""
    expert = tiny[0]
    monkeypatch.setattr(fused_expert, "interpreting", lambda: False)
    fused = FusedExpert(expert)
    runs = {(b, h): fused.runs_persistent(fused.buffers(b, h, 20, 1, "cpu")) for b, h in ((1, 16), (4, 16), (8, 16),
                                                                                          (2, 32), (1, 64))}
    assert runs == {(1, 16): True, (4, 16): True, (8, 16): True, (2, 32): True, (1, 64): False}


def test_engine_with_the_fused_expert_matches_the_reference_engine():
    """The engine's action stage on the kernel (static runner: one flow() per query) against the
    same engine's reference loop, with an action-cache schedule."""
    overrides = dict(fused=True, action_cache="2-3:1", flow_steps=4)
    if DEVICE == "cpu":
        overrides["dtype"] = "float32"
    ref = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, **overrides))
    fused = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, fused_expert=True, **overrides))
    for seed in range(2):
        obs = ref.dummy_observation(seed=seed)
        noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(seed)).to(ref.device)
        a, b = ref.predict(obs, noise=noise).normalized, fused.predict(obs, noise=noise).normalized
        assert np.abs(a - b).max() < 1e-4
    obs.known_actions = ref.predict(obs, noise=noise).actions[:3]     # the inpainting loop in the runner
    a, b = ref.predict(obs, noise=noise).normalized, fused.predict(obs, noise=noise).normalized
    assert np.abs(a - b).max() < 1e-4 and np.array_equal(a[:3], b[:3])


# The interpreter accepts code the GPU compiler rejects: every kernel a full-size fp8 FusedExpert
# launches (a superset of the bf16 paths) compiled for sm_90 with ptxas and no GPU. The count is
# of configurations as Triton keys its compiles: the persistent loop and the inpainting loop's
# launch a step are one (each more costs a fresh machine's warm-up ~20 s), the per-phase launches
# one a phase whatever their block.
COMPILE_SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "compile_flow_kernel.py")


def compile_for_hopper(mode: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, COMPILE_SCRIPT, mode, "--fp8", "--inpaint"], env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.fixture(scope="module", autouse=True)
def hopper_compiles(request):
    """{mode: the future of its compile_for_hopper run} for the selected cases of
    test_every_kernel_configuration_compiles_for_hopper, started when the module starts and run one
    after the other on a thread: each is a process of its own, on the core that the interpreter's
    cases (one thread) leave idle, and the test takes its result when it comes to it."""
    modes = [] if DEVICE == "cuda" else [
        item.callspec.params["mode"] for item in request.session.items
        if item.module is request.module and item.originalname == "test_every_kernel_configuration_compiles_for_hopper"]
    pool = ThreadPoolExecutor(max_workers=1)
    try:
        yield {mode: pool.submit(compile_for_hopper, mode) for mode in modes}
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


@pytest.mark.skipif(DEVICE == "cuda", reason="on the GPU every configuration runs natively")
@pytest.mark.parametrize("mode, kernels", [("persistent", 1), ("per-phase", 10)])
def test_every_kernel_configuration_compiles_for_hopper(hopper_compiles, mode, kernels):
    done = hopper_compiles[mode].result()
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"{kernels} kernel configurations compiled for sm_90" in done.stdout


# -- GPU only -----------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("entries", [1, 2])
def test_persistent_flow_on_gpu_replays_bit_identically_and_matches_per_phase(entries):
    expert, kv, mask, noise = expert_inputs("molmobot-4b" if entries == 1 else "tiny", entries, 200)
    expert16 = copy.deepcopy(expert).to(torch.bfloat16)
    table, table16 = mod_table(expert, 10), mod_table(expert16, 10)
    kv16 = [(k.bfloat16(), v.bfloat16()) for k, v in kv]
    truth = reference_flow(expert, table, kv, mask, noise)
    eager16 = reference_flow(expert16, table16, kv16, mask, noise)
    persistent, per_phase = FusedExpert(expert16), FusedExpert(expert16, tiling=Tiling(persistent=False))
    with torch.no_grad():
        stepwise = per_phase.flow(noise, per_phase.schedule(table16), kv16, mask).clone()
        inputs = persistent.schedule(table16)
        graph, out = capture(lambda: persistent.flow(noise, inputs, kv16, mask))
        graph.replay()
        first = out.clone()
        for _ in range(50):
            graph.replay()
            assert torch.equal(out, first)
    assert not persistent.barrier_timed_out()
    # The same phases compiled into two kernels: a rounding apart (3e-6 measured), far inside bf16 noise.
    assert rel(first, stepwise) < 1e-4
    assert rel(first, truth) < 1.5 * rel(eager16, truth) + 1e-3


@pytest.mark.cuda
def test_inpainting_on_the_persistent_kernel_replays_one_graph_for_every_prefix_length():
    """One persistent launch per flow step, the prefix inpainted between them, captured once: a
    replay with another prefix length (a new mask in the same buffer) keeps that prefix exactly
    and matches the per-phase launches."""
    expert, kv, mask, noise = expert_inputs("tiny", 2, 200)
    expert16 = copy.deepcopy(expert).to(torch.bfloat16)
    table16, kv16 = mod_table(expert16, 10), [(k.bfloat16(), v.bfloat16()) for k, v in kv]
    persistent, per_phase = FusedExpert(expert16), FusedExpert(expert16, tiling=Tiling(persistent=False))
    known = known_prefix(noise, 0)
    inputs = persistent.schedule(table16)
    with torch.no_grad():
        graph, out = capture(lambda: persistent.flow(noise, inputs, kv16, mask, known))
        for k in (1, 4, 9):
            known.known.copy_(known_prefix(noise, k).known)
            graph.replay()
            assert torch.equal(out[:, :k], known.values[:, :k])
            stepwise = per_phase.flow(noise, per_phase.schedule(table16), kv16, mask, known)
            assert rel(out, stepwise) < 1e-4
    assert not persistent.barrier_timed_out()

