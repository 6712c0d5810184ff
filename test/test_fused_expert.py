"""The fused action-expert kernels and FusedExpert against PyTorch: each kernel against its
float64 reference (on the CPU through TRITON_INTERPRET=1, set by conftest.py), FusedExpert
against ActionExpert.velocity of the tiny model, and every kernel configuration of the
full-size expert compiled for sm_90 (no GPU needed). GPU checks (bf16 dots, graph replays,
PDL) are marked cuda.

Tolerances: fp32 paths 1e-5 relative. bf16 models: within bf16 noise, i.e. as far from the fp32
model as eager bf16 is (both ~7e-3 on the tiny model; under the interpreter the dots run in
fp32, on the GPU in bf16)."""
import copy
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from vla_node.model import build_model, get_preset, init_random_
from vla_node.model.action_expert import LN_EPS
from vla_node.runtime.fused_expert import FusedExpert
from vla_node.runtime.kernels.expert_block import (
    SplitScratch,
    Tiling,
    cross_attention,
    cross_partials,
    head_linear,
    linear,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Small tiles so the tiny shapes still take every path: several K steps, split-K, key splits.
SMALL = Tiling(block_k=32, head_block_n=16, keys_per_split=32, block_keys=16, min_programs=64)
TOL = 1e-5 if DEVICE == "cpu" else 2e-3  # tf32 dots on the GPU


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def randn(*shape, g):
    return torch.randn(*shape, generator=g).to(DEVICE)


def scratch() -> SplitScratch:
    return SplitScratch.create(256, 1 << 16, DEVICE)


def ref_modulated_ln(x, mod, tokens, shift, scale):
    """float64 modulate(LayerNorm(x)) of rows x [M, K] with mod [entries|1, C]."""
    rows = mod.double()[torch.arange(x.shape[0], device=x.device) // tokens % mod.shape[0]]
    k = x.shape[1]
    return F.layer_norm(x.double(), (k,), eps=LN_EPS) * (1 + rows[:, scale:scale + k]) + rows[:, shift:shift + k]


def ref_attention(q, k, v, entries, heads, mask=None):
    """q [M, w] rows of `entries` entries, k/v [entries, heads, T, D] -> SDPA in float64 -> [M, w]."""
    qh = q.double().view(entries, -1, heads, k.shape[-1]).transpose(1, 2)
    y = F.scaled_dot_product_attention(qh, k.double(), v.double(), attn_mask=mask)
    return y.transpose(1, 2).reshape(q.shape)


@pytest.mark.parametrize("m, tokens, k, n, norm, gelu, gate, residual", [
    (16, 16, 64, 48, True, False, True, "stream"),      # LN prologue, gate + residual in place
    (12, 6, 64, 40, True, True, False, None),          # two batch entries, padded rows and columns, GELU
    (16, 8, 128, 32, False, False, True, "stream"),    # fc2: split over K, in place
    (16, 16, 8, 64, False, False, False, "period"),    # action_in: + position rows (period = tokens)
])
def test_linear_matches_reference(m, tokens, k, n, norm, gelu, gate, residual):
    g = torch.Generator().manual_seed(m * k + n)
    x, w, b = randn(m, k, g=g) * 2 + 0.5, randn(n, k, g=g) / k ** 0.5, randn(n, g=g)
    mod = randn(m // tokens, 4 * max(k, n), g=g) * 0.5
    res = {"stream": randn(m, n, g=g), "period": randn(tokens, n, g=g), None: None}[residual]
    out = res.clone() if residual == "stream" else torch.full((m, n), float("nan"), device=DEVICE)
    linear(x, w, b, out, scratch(), compute=torch.float32, mod=mod, norm=(0, k) if norm else None,
           gate=2 * k if gate else None, gelu=gelu, residual=res, tokens=tokens, tiling=SMALL)
    a = ref_modulated_ln(x, mod, tokens, 0, k) if norm else x.double()
    ref = a @ w.double().T + b.double()
    ref = F.gelu(ref) if gelu else ref
    if gate:
        ref = ref * mod.double()[torch.arange(m, device=DEVICE) // tokens][:, 2 * k:2 * k + n]
    if res is not None:
        ref = ref + res.double()[torch.arange(m, device=DEVICE) % res.shape[0]]
    assert torch.isfinite(out).all()
    assert rel(out, ref) < TOL


@pytest.mark.parametrize("entries, tokens, heads, d", [(1, 16, 4, 16), (2, 8, 2, 24)])
def test_self_attention_out_projection_matches_sdpa(entries, tokens, heads, d):
    g = torch.Generator().manual_seed(tokens * d)
    m, width = entries * tokens, heads * d
    x, qkv = randn(m, width, g=g), randn(m, 3 * width, g=g)
    w, b, mod = randn(width, width, g=g) / width ** 0.5, randn(width, g=g), randn(entries, 9 * width, g=g)
    out = x.clone()
    head_linear(out, w, b, mod, 2 * width, scratch(), heads=heads, tokens=tokens, compute=torch.float32,
                qkv=qkv, tiling=SMALL)
    q, k, v = (t.view(entries, tokens, heads, d).transpose(1, 2) for t in qkv.split(width, dim=1))
    y = ref_attention(q.transpose(1, 2).reshape(m, width), k, v, entries, heads)
    gate = mod.double()[torch.arange(m, device=DEVICE) // tokens][:, 2 * width:3 * width]
    assert rel(out, x.double() + gate * (y @ w.double().T + b.double())) < TOL


@pytest.mark.parametrize("entries, n_keys, project, masked, d", [
    (1, 100, True, True, 16),     # 4 key splits, the last partial, q projected in the kernel
    (1, 17, False, False, 16),    # one split, queries given
    (2, 70, True, True, 24),      # a mask per batch entry, head_dim not a power of two (like 96)
])
def test_cross_attention_and_merge_projection_match_sdpa(entries, n_keys, project, masked, d):
    g = torch.Generator().manual_seed(n_keys)
    tokens, heads = 16, 4
    m, width = entries * tokens, heads * d
    x = randn(m, width, g=g)
    mod = randn(entries, 9 * width, g=g) * 0.5
    wq, bq = randn(width, width, g=g) / width ** 0.5, randn(width, g=g)
    # K/V as the model makes them: head views into one fused [entries, T, 2w] projection.
    fused_kv = randn(entries, n_keys, 2 * width, g=g)
    k, v = (t.view(entries, n_keys, heads, d).transpose(1, 2) for t in fused_kv.split(width, -1))
    mask = None
    if masked:
        mask = torch.rand(entries, 1, 1, n_keys, generator=g).to(DEVICE) > 0.3
        mask[..., 0] = True
    partials = cross_partials(entries, heads, tokens, d, n_keys, SMALL, DEVICE)
    for p in partials:
        p.fill_(float("nan"))  # any slot the merge reads must have been written
    mask_rows = mask.reshape(entries, n_keys) if masked else None
    if project:
        cross_attention(x, k, v, mask_rows, partials, tokens=tokens, compute=torch.float32, q_weight=wq, q_bias=bq,
                        mod=mod, norm=(3 * width, 4 * width), tiling=SMALL)
        q = ref_modulated_ln(x, mod, tokens, 3 * width, 4 * width) @ wq.double().T + bq.double()
    else:
        cross_attention(x, k, v, mask_rows, partials, tokens=tokens, compute=torch.float32, tiling=SMALL)
        q = x.double()
    wo, bo = randn(width, width, g=g) / width ** 0.5, randn(width, g=g)
    out = x.clone()
    head_linear(out, wo, bo, mod, 5 * width, scratch(), heads=heads, tokens=tokens, compute=torch.float32,
                partials=partials, tiling=SMALL)
    y = ref_attention(q, k, v, entries, heads, mask)
    gate = mod.double()[torch.arange(m, device=DEVICE) // tokens][:, 5 * width:6 * width]
    assert rel(out, x.double() + gate * (y @ wo.double().T + bo.double())) < TOL


# -- FusedExpert against the model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    """The tiny model's expert (fp32), a 40-token context per block, and the inputs of one step."""
    model = init_random_(build_model(get_preset("tiny"), DEVICE))
    g = torch.Generator().manual_seed(0)
    hidden = [randn(1, 40, model.cfg.llm.dim, g=g) for _ in model.expert.blocks]
    mask = torch.ones(1, 1, 1, 41, dtype=torch.bool, device=DEVICE)
    mask[..., 25:40] = False  # padded instruction tokens; the state token (last) stays
    return model.expert, hidden, randn(1, 8, g=g), randn(1, 16, 8, g=g), mask


def step_inputs(expert, hidden, state, t=0.3):
    dtype = expert.action_pos.dtype
    with torch.no_grad():
        return expert.modulations(torch.tensor([t], device=DEVICE)), expert.context_kv(
            [h.to(dtype) for h in hidden], state.to(dtype))


@pytest.mark.parametrize("masked, project_in_attention, tiling", [
    (True, True, SMALL),       # split-K everywhere, several key splits
    (False, True, Tiling()),   # the GPU tiles
    (True, False, Tiling()),   # q projection as its own linear (7 launches per block)
])
def test_fused_velocity_matches_expert(tiny, masked, project_in_attention, tiling):
    expert, hidden, state, x, mask = tiny
    mods, kv = step_inputs(expert, hidden, state)
    ctx_mask = mask if masked else None
    with torch.no_grad():
        ref = expert.velocity(x, mods, kv, ctx_mask)
        fused = FusedExpert(expert, project_in_attention=project_in_attention, tiling=tiling)
        out = fused.velocity(x, mods, kv, ctx_mask)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert rel(out, ref) < TOL


def test_fused_velocity_is_deterministic_and_leaves_counters_zero(tiny):
    expert, hidden, state, x, mask = tiny
    mods, kv = step_inputs(expert, hidden, state)
    fused = FusedExpert(expert)
    first = fused.velocity(x, mods, kv, mask)
    assert torch.equal(fused.velocity(x, mods, kv, mask), first)  # split-K sums in split order
    (buffers,) = fused._buffers.values()
    assert not buffers.scratch.counter.any()


def test_fused_velocity_of_bf16_expert_is_within_bf16_noise(tiny):
    expert, hidden, state, x, mask = tiny
    expert16 = copy.deepcopy(expert).to(torch.bfloat16)
    mods, kv = step_inputs(expert, hidden, state)
    mods16, kv16 = step_inputs(expert16, hidden, state)
    with torch.no_grad():
        ref = expert.velocity(x, mods, kv, mask)
        eager16 = expert16.velocity(x.bfloat16(), mods16, kv16, mask)
        fused16 = FusedExpert(expert16).velocity(x.bfloat16(), mods16, kv16, mask)
    assert fused16.dtype == torch.bfloat16
    assert rel(eager16, ref) < 2e-2
    assert rel(fused16, ref) < 1.5 * rel(eager16, ref)


def dequantized_copy(expert, fused):
    """The expert with every block linear replaced by the fused expert's dequantised e4m3 weights."""
    out = copy.deepcopy(expert)
    for blk, weights in zip(out.blocks, fused.blocks):
        qkv = weights.qkv.dequantized().split(blk.self_qkv.sizes)
        for name, w in zip(blk.self_qkv.names, qkv):
            getattr(blk.self_qkv, name).weight.copy_(w)
        for name in ("self_out", "cross_q", "cross_out", "fc1", "fc2"):
            getattr(blk, name).weight.copy_(getattr(weights, name).dequantized())
    return out


def test_fp8_velocity_matches_its_dequantized_expert(tiny):
    expert, hidden, state, x, mask = tiny
    fused = FusedExpert(expert, fp8=True)
    assert fused.blocks[0].fc1.weight.dtype == torch.float8_e4m3fn
    reference = dequantized_copy(expert, fused)
    mods, kv = step_inputs(expert, hidden, state)
    with torch.no_grad():
        out = fused.velocity(x, mods, kv, mask)
        ref = reference.velocity(x, mods, kv, mask)
        plain = expert.velocity(x, mods, kv, mask)
    assert rel(out, ref) < TOL
    assert 1e-4 < rel(out, plain) < 5e-2  # e4m3 really changes the numbers, by a little


def test_fused_velocity_traces_as_one_opaque_op(tiny):
    expert, hidden, state, x, mask = tiny
    mods, kv = step_inputs(expert, hidden, state)
    fused = FusedExpert(expert)
    compiled = torch.compile(lambda x: fused.velocity(x, mods, kv, mask), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), fused.velocity(x, mods, kv, mask))


def test_fused_velocity_rejects_more_than_64_rows(tiny):
    expert, hidden, state, x, mask = tiny
    mods, kv = step_inputs(expert, hidden, state)
    with pytest.raises(ValueError, match="at most 64 rows"):
        FusedExpert(expert).velocity(torch.zeros(5, 16, 8, device=DEVICE), mods, kv)


# The interpreter accepts code the GPU compiler rejects (it ran a kernel that read a plain Python
# global). This compiles, with the CUDA backend and ptxas and no GPU, every kernel configuration a
# full-size fp8 FusedExpert with PDL launches (a superset of the bf16 code paths).
HOPPER_COMPILE = r"""
import torch
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile
from triton.runtime.jit import JITFunction

launches = {}
def record(self, *args, grid, warmup, **kwargs):
    launches.setdefault((self.fn.__name__, tuple(sorted(map(str, kwargs.items())))), (self, args, kwargs))
JITFunction.run = record

from vla_node.model import get_preset
from vla_node.model.action_expert import ActionExpert
from vla_node.runtime.fused_expert import FusedExpert
from vla_node.runtime.fusion import fuse_projections

with torch.device("meta"):
    expert = ActionExpert(get_preset("molmobot-4b")).to(torch.bfloat16)
    fuse_projections(expert)
    kv = [(torch.empty(1, 8, 1651, 96, dtype=torch.bfloat16),) * 2 for _ in expert.blocks]
    mods = ([torch.empty(1, 9 * 768, dtype=torch.bfloat16)] * 36, torch.empty(1, 2 * 768, dtype=torch.bfloat16))
    mask = torch.empty(1, 1, 1, 1651, dtype=torch.bool)
    # run(), not velocity(): the custom op would answer meta tensors with its fake.
    FusedExpert(expert, fp8=True, pdl=True).run(torch.empty(1, 16, 8), *mods, *zip(*kv), mask)
TYPES = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float8_e4m3fn: "*fp8e4nv", torch.int32: "*i32",
         torch.bool: "*i1"}
for (name, _), (kernel, args, kwargs) in launches.items():
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages", "launch_pdl") if k in kwargs}
    types = iter(TYPES[a.dtype] if isinstance(a, torch.Tensor) else "fp32" if isinstance(a, float) else "i32"
                 for a in args)
    signature = {p: "constexpr" if p in kwargs else next(types) for p in kernel.arg_names}
    compile(ASTSource(kernel, signature, kwargs), target=GPUTarget("cuda", 90, 32), options=options)
assert len(launches) >= 7, launches.keys()
print(len(launches), "kernel configurations compiled for sm_90")
"""


@pytest.mark.skipif(DEVICE == "cuda", reason="on the GPU every configuration runs natively")
def test_every_kernel_configuration_compiles_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", HOPPER_COMPILE], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernel configurations compiled for sm_90" in done.stdout


# -- GPU only -----------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("pdl", [False, True])
def test_fused_velocity_bf16_on_gpu_replays_bit_identically(tiny, pdl):
    if pdl and torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper")
    expert, hidden, state, x, mask = tiny
    expert16 = copy.deepcopy(expert).to(torch.bfloat16)
    mods, kv = step_inputs(expert, hidden, state)
    mods16, kv16 = step_inputs(expert16, hidden, state)
    fused = FusedExpert(expert16, pdl=pdl)
    with torch.no_grad():
        ref = expert.velocity(x, mods, kv, mask)
        eager16 = expert16.velocity(x.bfloat16(), mods16, kv16, mask)
        fused.velocity(x, mods16, kv16, mask)  # buffers and compilation before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused.velocity(x, mods16, kv16, mask)
        graph.replay()
        first = out.clone()
        for _ in range(50):
            graph.replay()
            assert torch.equal(out, first)
    assert rel(first, ref) < 1.5 * rel(eager16, ref) + 1e-3
