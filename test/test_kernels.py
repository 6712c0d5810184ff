"""Triton kernels against PyTorch references: on the CPU through TRITON_INTERPRET=1 (set by
conftest.py when there is no GPU), on the GPU natively."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vla_node.runtime.kernels.few_query_attention import few_query_attention
from vla_node.runtime.kernels.layer_norm import TritonLayerNorm, layer_norm_into
from vla_node.runtime.kernels.rotary_heads import rotary_heads_kernel

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("batch, heads, queries, keys, dim, masked", [
    (1, 8, 16, 16, 96, False),     # expert self-attention
    (1, 8, 16, 300, 96, True),     # cross-attention with padding masked
    (2, 4, 16, 129, 64, True),     # a partial last chunk, a mask per batch entry
    (1, 2, 32, 70, 16, False),
])
def test_few_query_attention_matches_sdpa(batch, heads, queries, keys, dim, masked):
    g = torch.Generator().manual_seed(keys)
    # Queries as a transposed view, like the model's [B, T, H, D] -> [B, H, T, D].
    q = torch.randn(batch, queries, heads, dim, generator=g).to(DEVICE).transpose(1, 2)
    k = torch.randn(batch, heads, keys, dim, generator=g).to(DEVICE)
    v = torch.randn(batch, heads, keys, dim, generator=g).to(DEVICE)
    mask = None
    if masked:
        mask = torch.rand(batch, 1, 1, keys, generator=g) > 0.3
        mask[..., 0] = True
        mask = mask.to(DEVICE)
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask)
    out = few_query_attention(q, k, v, mask)
    assert out.shape == ref.shape and out.dtype == q.dtype
    tol = 1e-5 if DEVICE == "cpu" else 3e-3  # tf32 dots on the GPU
    assert float((out.double() - ref).norm() / ref.norm()) < tol


def test_few_query_attention_rejects_odd_query_counts():
    q = torch.zeros(1, 2, 10, 16)
    with pytest.raises(ValueError, match="power-of-two"):
        few_query_attention(q, q, q)


@pytest.mark.parametrize("device", [
    pytest.param("cpu", marks=pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter run is CI's")),
    pytest.param("cuda", marks=pytest.mark.cuda)])
def test_few_query_attention_runs_on(device):
    """The same call on the CPU (interpreter) and, on the GPU machine, natively."""
    if device == "cuda":
        q = torch.randn(1, 8, 16, 96, device=device, dtype=torch.bfloat16)
        k = torch.randn(1, 8, 1677, 96, device=device, dtype=torch.bfloat16)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), k.float())
        out = few_query_attention(q, k, k).float()
        assert float((out - ref).norm() / ref.norm()) < 1e-2
    else:
        assert few_query_attention(*(torch.randn(1, 2, 16, 8) for _ in range(3))).shape == (1, 2, 16, 8)


def test_engine_with_triton_attention_matches_sdpa():
    from vla_node.runtime import EngineConfig, PolicyEngine

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, dtype=dtype))
    kernel = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, dtype=dtype, triton_attention=True))
    obs = plain.dummy_observation()
    noise = torch.randn(1, 16, 8, device=DEVICE)
    a = plain.predict(obs, noise=noise).normalized
    b = kernel.predict(obs, noise=noise).normalized
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < (1e-5 if DEVICE == "cpu" else 1e-2)


@pytest.mark.parametrize("rows, n, affine", [(2916, 1152, True), (37, 768, False), (5, 64, True), (1, 40, False)])
def test_layer_norm_rows_match_torch_into_a_wider_buffer(rows, n, affine):
    g = torch.Generator().manual_seed(n)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = (torch.randn(rows, n, generator=g) * 3 + 1).to(DEVICE, dtype)
    weight, bias = (torch.randn(n, generator=g).to(DEVICE, dtype) for _ in range(2)) if affine else (None, None)
    wide = torch.full((rows, n + 8), 7.0, device=DEVICE, dtype=dtype)     # out: a row stride of n + 8
    out = layer_norm_into(x, wide[:, :n], weight, bias, 1e-6)
    ref = F.layer_norm(x.double(), (n,), None if weight is None else weight.double(),
                       None if bias is None else bias.double(), 1e-6)
    scale = ref.abs().max().item()
    assert (out.double() - ref).abs().max().item() <= (1e-5 if DEVICE == "cpu" else 8e-3) * scale
    assert bool((wide[:, n:] == 7.0).all())   # nothing written past the rows
    with pytest.raises(ValueError, match="contiguous last dim"):
        layer_norm_into(x.t(), wide[:, :n], weight, bias, 1e-6)


def test_layer_norm_into_rows_of_groups_with_other_rows_between():
    """The expert's context tokens (runtime/fusion.BatchedContextKV): each (block, entry)'s t rows
    normalised straight into a buffer of t + 1 rows a group (the state token's row between), n + 8
    columns (the bias column and padding); norm_into is the norm, one pass for a TritonLayerNorm."""
    from vla_node.runtime.kernels.layer_norm import TritonLayerNorm, norm_into

    groups, t, n = 6, 37, 96
    g = torch.Generator().manual_seed(3)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = (torch.randn(3, 2, t, n, generator=g) * 3 + 1).to(DEVICE, dtype)
    ref = F.layer_norm(x.double(), (n,), None, None, 1e-5)
    tolerance = (1e-5 if DEVICE == "cpu" else 8e-3) * ref.abs().max().item()
    wide = torch.full((3, 2, t + 1, n + 8), 7.0, device=DEVICE, dtype=dtype)
    layer_norm_into(x.view(-1, n), wide.view(groups, t + 1, n + 8)[:, :t, :n], None, None, 1e-5)
    assert (wide[:, :, :t, :n].double() - ref).abs().max().item() <= tolerance
    assert bool((wide[:, :, t] == 7.0).all()) and bool((wide[..., n:] == 7.0).all())   # the other rows, columns
    wide.fill_(7.0)
    norm_into(TritonLayerNorm(torch.nn.LayerNorm(n, eps=1e-5, elementwise_affine=False)), x, wide[:, :, :t, :n])
    assert (wide[:, :, :t, :n].double() - ref).abs().max().item() <= tolerance
    assert bool((wide[:, :, t] == 7.0).all()) and bool((wide[..., n:] == 7.0).all())
    with pytest.raises(ValueError, match="out of x's rows"):
        layer_norm_into(x.view(-1, n), wide.view(groups, t + 1, n + 8)[:, :t - 1, :n], None, None, 1e-5)


@pytest.mark.parametrize("rows, n", [(2916, 1152), (5, 64)])
def test_layer_norm_with_a_residual_is_the_add_then_the_norm(rows, n):
    """The ViT block's add_norm in one pass: x + delta rounded as the add it replaces (bit for bit)
    and written out, and its LayerNorm as the norm of that sum; the op and the model's function agree."""
    from vla_node.model.vision import add_norm
    from vla_node.runtime.kernels.layer_norm import add_norm_one_pass

    g = torch.Generator().manual_seed(rows)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x, delta = ((torch.randn(rows, n, generator=g) * 3 + 1).to(DEVICE, dtype) for _ in range(2))
    norm = torch.nn.LayerNorm(n, eps=1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n, generator=g))
        norm.bias.copy_(torch.randn(n, generator=g))
        total = torch.empty_like(x)
        out = layer_norm_into(x, torch.empty_like(x), norm.weight, norm.bias, 1e-6, (delta, total))
        assert torch.equal(total, x + delta)
        ref = F.layer_norm((x + delta).double(), (n,), norm.weight.double(), norm.bias.double(), 1e-6)
        assert (out.double() - ref).abs().max().item() <= (1e-5 if DEVICE == "cpu" else 8e-3) * ref.abs().max().item()
        (t1, h1), (t2, h2) = add_norm(x, delta, norm), add_norm_one_pass(x, delta, norm)
        assert torch.equal(t1, t2)
        tolerance = (1e-5 if DEVICE == "cpu" else 8e-3) * h1.abs().max().item()
        assert (h1.float() - h2.float()).abs().max().item() <= tolerance
    with pytest.raises(ValueError, match="residual and its total"):
        layer_norm_into(x, torch.empty_like(x), None, None, 1e-6, (delta[:, :n // 2], total))


@pytest.mark.parametrize("options", [{"triton_layer_norm": True}, {"triton_layer_norm": True, "add_norm_kernel": True}])
def test_engine_with_triton_layer_norms_keeps_keys_and_results(options):
    from vla_node.runtime import EngineConfig, PolicyEngine
    from vla_node.runtime.kernels.layer_norm import add_norm_one_pass

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, dtype=dtype))
    kernel = PolicyEngine(EngineConfig.for_mode("ctxkv", device=DEVICE, dtype=dtype, **options))
    assert isinstance(kernel.model.vision.encoder.blocks[0].norm1, TritonLayerNorm)
    assert (kernel.model.vision.encoder.blocks[0].add_norm is add_norm_one_pass) == ("add_norm_kernel" in options)
    assert plain.model.state_dict().keys() == kernel.model.state_dict().keys()
    obs = plain.dummy_observation()
    noise = torch.randn(1, 16, 8, device=DEVICE)
    a = plain.predict(obs, noise=noise).normalized
    b = kernel.predict(obs, noise=noise).normalized
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < (1e-6 if DEVICE == "cpu" else 1e-2)


def _pattern(image: torch.Tensor) -> torch.Tensor:
    pos = torch.arange(image.numel(), device=image.device)
    return (pos[None, :] <= pos[:, None]) | (image[:, None] & image[None, :])


PATTERN_DEVICES = [
    pytest.param("cpu", torch.float32, marks=pytest.mark.skipif(torch.cuda.is_available(), reason="CI's run")),
    pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda),
    pytest.param("cuda", torch.float32, marks=pytest.mark.cuda)]


def _pattern_inputs(device, dtype, keys: int, q_offset: int, head_dim: int, seed: int):
    """q [2, 4, keys - q_offset, D], k/v [2, 2, keys, D] as a decoder layer makes them: strided views
    of one fused projection's output (q its rows from q_offset)."""
    g = torch.Generator().manual_seed(seed)
    fused = torch.randn(2, keys, 8 * head_dim, generator=g).to(device, dtype)
    widths = [4 * head_dim, 2 * head_dim, 2 * head_dim]
    q, k, v = (x.view(2, keys, -1, head_dim).transpose(1, 2) for x in fused.split(widths, -1))
    return q[:, :, q_offset:], k, v


def _pattern_error(out: torch.Tensor, q, k, v, image: torch.Tensor, q_offset: int) -> float:
    """Relative L2 of out against fp32 SDPA with the dense pattern (the queries' rows of it)."""
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=_pattern(image)[q_offset:],
                                         enable_gqa=True)
    return float((out.float() - ref).norm() / ref.norm())


def _pattern_tolerance(device, dtype) -> float:
    return 1e-2 if dtype == torch.bfloat16 else 1e-6 if device == "cpu" else 1e-5   # fp32 on the GPU: other sums


@pytest.mark.parametrize("device, dtype", PATTERN_DEVICES)
@pytest.mark.parametrize("keys, q_offset, head_dim, runs, tiles", [
    (70, 0, 16, ((3, 21), (25, 43)), {}),                          # image runs with text between them
    (70, 0, 32, ((3, 21), (50, 70)), dict(block_m=16, block_n=32)),  # a run reaching the last token
    (37, 0, 16, (), dict(block_m=16, block_n=16)),                  # no image tokens
    (70, 33, 16, ((3, 21), (25, 43), (60, 64)), dict(block_m=16, block_n=16)),  # queries: the last 37 rows
    # by pointer, not through tensor descriptors (whose copy engine zero-fills keys past S, queries past T)
    (70, 33, 16, ((3, 21), (25, 43), (60, 64)), dict(block_m=16, block_n=16, tma=False)),
    (70, 0, 32, ((3, 21), (50, 70)), dict(block_m=16, block_n=32, tma=False)),
])
def test_pattern_kernel_matches_the_dense_mask(device, dtype, keys, q_offset, head_dim, runs, tiles):
    """The prefill's pattern in one Triton kernel (interpreted on the CPU) gives the dense-mask
    result: grouped heads (4 over 2), strided q/k/v views, lengths no multiple of the tiles, queries
    offset into the keys (a streaming step's), the output a view of [B, T, H, D]."""
    from vla_node.runtime.kernels.pattern_attention import PatternAttention

    q, k, v = _pattern_inputs(device, dtype, keys, q_offset, head_dim, seed=keys + head_dim)
    image = torch.zeros(keys, dtype=torch.bool, device=device)
    for start, end in runs:
        image[start:end] = True
    out = PatternAttention(image, q_offset, **tiles).attend(q, k, v)
    assert out.shape == q.shape and out.transpose(1, 2).is_contiguous()
    assert _pattern_error(out, q, k, v, image, q_offset) < _pattern_tolerance(device, dtype)


@pytest.mark.parametrize("device, dtype", PATTERN_DEVICES)
def test_pattern_kernel_refreshes_its_tables_in_place(device, dtype):
    """Image tokens typed into the instruction later: refresh rewrites the flags and tile tables in
    the same tensors (as captured graphs need) and the kernel follows the new pattern."""
    from vla_node.runtime.kernels.pattern_attention import PatternAttention

    q, k, v = _pattern_inputs(device, dtype, 70, 0, 16, seed=1)
    image = torch.zeros(70, dtype=torch.bool, device=device)
    image[3:21] = image[25:43] = True
    pattern = PatternAttention(image, block_m=32, block_n=16)
    tables = (pattern.image, pattern.tiles, pattern.counts, pattern.order)
    before = [t.clone() for t in tables]
    image[60] = image[61] = True
    pattern.refresh(image)
    assert all(a is b for a, b in zip(tables, (pattern.image, pattern.tiles, pattern.counts, pattern.order)))
    assert not torch.equal(before[2], pattern.counts)
    assert _pattern_error(pattern.attend(q, k, v), q, k, v, image, 0) < _pattern_tolerance(device, dtype)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on the GPU the kernel runs natively")
@pytest.mark.parametrize("options", [[], ["--q-rope"]], ids=["default", "q_rope"])
def test_pattern_kernel_compiles_for_hopper_with_its_loads_pipelined(options):
    """The interpreter pipelines nothing and accepts code the GPU compiler rejects: the kernel at its
    default tiles, compiled for sm_90 with no GPU (scripts/compile_pattern_kernel.py), holds num_stages
    K and V tiles in shared memory; also as q_rope_in_attention launches it."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | {"PYTHONPATH": root}  # this checkout's
    done = subprocess.run([sys.executable, os.path.join(root, "scripts", "compile_pattern_kernel.py"), *options],
                          env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "loads pipelined" in done.stdout, done.stdout + done.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=pytest.mark.cuda)])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 16), (3, 1, 12)])   # 3 heads, half 6: masked lanes
def test_rotary_heads_kernel_is_the_model_s(dtype, heads, kv_heads, head_dim):
    """kernels/rotary_heads's one pass against model.llm.rotary_heads on views of one fused q/k/v
    output: q and k normed and rotated, v copied, all as contiguous [B, heads, T, D]. bf16 runs on the
    GPU only: the interpreter truncates fp32 to bf16 where the GPU rounds to nearest."""
    import dataclasses

    from vla_node.model import get_preset
    from vla_node.model.layers import rope_tables
    from vla_node.model.llm import Attention, rotary_heads

    cfg = dataclasses.replace(get_preset("tiny").llm, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    attn = Attention(cfg).to(DEVICE, dtype)
    g = torch.Generator().manual_seed(heads)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    sizes = ((heads + 2 * kv_heads) * head_dim,)
    fused = torch.randn(2, 7, *sizes, generator=g).to(DEVICE, dtype)
    q, k, v = fused.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    cos, sin = rope_tables(head_dim, torch.arange(3, 10, device=DEVICE), cfg.rope_theta)
    with torch.no_grad():
        ref = rotary_heads(attn, q, k, v, cos, sin)
        got = rotary_heads_kernel(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, heads, kv_heads,
                                  cfg.norm_eps)
    for a, b in zip(ref, got):
        assert b.shape == a.shape and b.is_contiguous()
        assert float((b.float() - a.float()).norm() / a.float().norm()) < (1e-6 if dtype == torch.float32 else 1e-3)
    assert torch.equal(got[2], ref[2])   # v: copied


@pytest.mark.parametrize("device, dtype", PATTERN_DEVICES)
@pytest.mark.parametrize("tma", [True, False])
def test_pattern_kernel_norms_and_rotates_q_as_the_rotary_pass_does(device, dtype, tma):
    """q_rope_in_attention's kernels against the rotary pass + the pattern kernel: k alone through the
    rotary pass (bit for bit its k), q normed and rotated as the pattern kernel loads it and v read
    where the projection wrote it (strided views of one fused output, 4 heads over 2, image runs)."""
    import dataclasses

    from vla_node.model import get_preset
    from vla_node.model.layers import rope_tables
    from vla_node.model.llm import Attention
    from vla_node.runtime.kernels.pattern_attention import PatternAttention
    from vla_node.runtime.kernels.rotary_heads import attend_rotating_q, rotary_keys_heads

    heads, kv_heads, head_dim, tokens = 4, 2, 16, 70
    cfg = dataclasses.replace(get_preset("tiny").llm, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    attn = Attention(cfg).to(device, dtype)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for norm in (attn.q_norm, attn.k_norm):
            norm.weight.copy_(torch.rand(head_dim, generator=g) + 0.5)
    fused = torch.randn(2, tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(device, dtype)
    q, k, v = fused.split((heads * head_dim, kv_heads * head_dim, kv_heads * head_dim), dim=-1)
    cos, sin = rope_tables(head_dim, torch.arange(tokens, device=device), cfg.rope_theta)
    image = torch.zeros(tokens, dtype=torch.bool, device=device)
    image[3:21] = image[25:43] = True
    pattern = PatternAttention(image, block_m=16, block_n=16, tma=tma)
    pattern.rope_tables = (cos, sin)
    with torch.no_grad():
        qr, kr, vr = rotary_heads_kernel(q, k, v, attn.q_norm.weight, attn.k_norm.weight, cos, sin, heads, kv_heads,
                                         cfg.norm_eps)
        want = pattern.attend(qr, kr, vr)
        q_raw, k_fused, v_raw = rotary_keys_heads(attn, q, k, v, cos, sin)
        got = attend_rotating_q(attn, q_raw, k_fused, v_raw, pattern)
    assert torch.equal(k_fused, kr) and k_fused.is_contiguous()
    assert v_raw.data_ptr() == v.data_ptr() and q_raw.data_ptr() == q.data_ptr()   # read where they lie
    assert got.shape == want.shape
    err = float((got.float() - want.float()).norm() / want.float().norm())
    assert err < (1e-6 if dtype == torch.float32 else 2e-3), err   # bf16: q may round the other way, rarely


def test_an_engine_with_q_rope_in_attention_matches_the_rotary_pass():
    """q_rope_in_attention in an engine (the kernels interpreted on the CPU, fp32): the same chunks as
    the rotary pass with the pattern kernel, at two instructions (two buckets); it needs the pattern
    kernel and no streaming."""
    from vla_node.runtime import EngineConfig, PolicyEngine

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    cfg = dict(device=DEVICE, dtype=dtype, flex_attention=True, pattern_kernel=True, rotary_kernel=True)
    plain = PolicyEngine(EngineConfig.for_mode("compile", **cfg))
    fused = PolicyEngine(EngineConfig.for_mode("compile", q_rope_in_attention=True, **cfg))
    for seed, text in enumerate(["pick up the red cup", "put the marker in the bowl and close the lid " * 3]):
        obs = plain.dummy_observation(seed=seed)
        obs.instruction = text
        noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
        a, b = plain.predict(obs, noise=noise).normalized, fused.predict(obs, noise=noise).normalized
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < (1e-6 if DEVICE == "cpu" else 1e-2)
    with pytest.raises(ValueError, match="q_rope_in_attention needs pattern_kernel"):
        EngineConfig.for_mode("ctxkv", q_rope_in_attention=True)
    with pytest.raises(ValueError, match="not with streaming_kv"):
        EngineConfig.for_mode("compile", **cfg, q_rope_in_attention=True, vision_cache=True, streaming_kv=True)


def test_engine_with_the_rotary_kernel_matches_the_model_s_path_also_when_streaming():
    """rotary_kernel in an engine: the same chunks as the model's path (fp32 on the CPU), for full
    queries and for the streaming step (the new frames' rows, at their slots' positions)."""
    from test_options import window_stream
    from vla_node.runtime import EngineConfig, PolicyEngine

    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    cfg = dict(device=DEVICE, dtype=dtype, vision_cache=True, streaming_kv=True)
    plain = PolicyEngine(EngineConfig.for_mode("ctxkv", **cfg))
    kernel = PolicyEngine(EngineConfig.for_mode("ctxkv", rotary_kernel=True, **cfg))
    for obs in window_stream(2):   # a full query, then a streaming step
        noise = torch.randn(1, 16, 8, generator=torch.Generator().manual_seed(len(obs.images))).to(DEVICE)
        a, b = plain.predict(obs, noise=noise).normalized, kernel.predict(obs, noise=noise).normalized
        assert np.linalg.norm(a - b) / np.linalg.norm(a) < (1e-6 if DEVICE == "cpu" else 1e-2)
    assert kernel.static.stream_steps == plain.static.stream_steps == 1
