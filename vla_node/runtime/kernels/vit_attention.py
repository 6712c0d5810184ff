"""The ViT's attention (each image's patches see each other, all of them) as one Triton
flash-attention kernel that reads q, k and v where the fused qkv projection wrote them and writes
the output projection's layout: no transposes, no copies around it.

Why: SigLIP2-so400m's heads are 72 wide. cuDNN ran them at 38.8 us a layer at DROID on the H200
against a 12.4 us floor (BENCHMARKS.md, the eighteenth session's profile; padding the heads to 80
or 128 for the flash or efficient kernels was slower, the twelfth session), with the layout copy
of its output after it. Here a head that is not a power of two is split into its largest
power-of-two part and a remainder padded to 16 lanes (72 = 64 + 8 of 16): each dot runs on both
parts, 80 / 72 of the work instead of 128 / 72. The padded lanes load as zeros, so the scores are
the full head's and the padded output columns are never stored.

Online softmax in fp32 with exp2 (the scale folded with log2 e, SDPA's 1 / sqrt(head_dim)), dots
in the inputs' dtype with fp32 accumulation (fp32 inputs in full precision, not TF32). Runs on the
CPU under TRITON_INTERPRET=1 (the CI tests); `vit_attention_kernel` in EngineConfig puts it in the
ViT's blocks.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .few_query_attention import precise_dot

LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(acc_a, acc_b, m_i, l_i, qa, qb, K, V, start, T, skt, svt, da, db, qk_scale,
                 D: tl.constexpr, HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Keys start .. start + BLOCK_N - 1 into the online softmax state (acc_a | acc_b, m_i in log2
    units, l_i). A MASKED tile (the last, partial one) reads no key past T."""
    keys = start + tl.arange(0, BLOCK_N)
    in_range = keys < T
    K += keys[:, None] * skt
    V += keys[:, None] * svt
    if MASKED:
        ka = tl.load(K + da[None, :], mask=in_range[:, None], other=0.0)
        va = tl.load(V + da[None, :], mask=in_range[:, None], other=0.0)
    else:
        ka = tl.load(K + da[None, :])
        va = tl.load(V + da[None, :])
    s = precise_dot(qa, tl.trans(ka))
    if HAS_B:
        kb = tl.load(K + db[None, :], mask=in_range[:, None] & (db < D)[None, :], other=0.0)
        s = precise_dot(qb, tl.trans(kb), s)
    s = s * qk_scale
    if MASKED:
        s = tl.where(in_range[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(va.dtype)
    acc_a = precise_dot(p, va, acc_a * alpha[:, None])
    if HAS_B:
        vb = tl.load(V + db[None, :], mask=in_range[:, None] & (db < D)[None, :], other=0.0)
        acc_b = precise_dot(p, vb, acc_b * alpha[:, None])
    return acc_a, acc_b, m_new, l_i


@triton.jit
def _vit_attention(Q, K, V, Out, T, heads, qk_scale, sqb, sqt, sqh, skb, skt, skh, svb, svt, svh,
                   D: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    bh = tl.program_id(0)                        # (image, head) fastest: every head of a query tile together
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < T
    da = tl.arange(0, DA)
    db = DA + tl.arange(0, DB)
    HAS_B: tl.constexpr = DA < D
    # Offsets of 8 elements (the host checks): 16-byte loads, which the pipeline's async copies need
    Q += tl.multiple_of(b * sqb + h * sqh, 8)
    K += tl.multiple_of(b * skb + h * skh, 8)
    V += tl.multiple_of(b * svb + h * svh, 8)
    qa = tl.load(Q + rows[:, None] * sqt + da[None, :], mask=row_ok[:, None], other=0.0)
    qb = tl.load(Q + rows[:, None] * sqt + db[None, :], mask=row_ok[:, None] & (db < D)[None, :], other=0.0)
    acc_a = tl.zeros([BLOCK_M, DA], tl.float32)
    acc_b = tl.zeros([BLOCK_M, DB], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    whole = T // BLOCK_N * BLOCK_N
    for start in range(0, whole, BLOCK_N):
        acc_a, acc_b, m_i, l_i = _attend_keys(acc_a, acc_b, m_i, l_i, qa, qb, K, V, start, T, skt, svt, da, db,
                                              qk_scale, D, HAS_B, BLOCK_N, False)
    if whole < T:
        acc_a, acc_b, m_i, l_i = _attend_keys(acc_a, acc_b, m_i, l_i, qa, qb, K, V, whole, T, skt, svt, da, db,
                                              qk_scale, D, HAS_B, BLOCK_N, True)
    out = Out + ((b * T + rows[:, None]) * heads + h) * D
    tl.store(out + da[None, :], (acc_a / l_i[:, None]).to(Out.dtype.element_ty), mask=row_ok[:, None])
    if HAS_B:
        tl.store(out + db[None, :], (acc_b / l_i[:, None]).to(Out.dtype.element_ty),
                 mask=row_ok[:, None] & (db < D)[None, :])


def head_parts(d: int) -> tuple[int, int]:
    """A head of d lanes as (its largest power-of-two part, the rest padded to a power of two >= 16;
    16 when there is no rest, then unused)."""
    da = 1 << (d.bit_length() - 1)
    return da, max(16, triton.next_power_of_2(d - da)) if d > da else 16


def vit_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_m: int = 64, block_n: int = 64,
                  num_warps: int = 4, num_stages: int = 3) -> torch.Tensor:
    """q, k, v [B, T, H, D] (any strides, the head dim contiguous: the fused qkv's views) ->
    [B, T, H * D] contiguous, softmax(q k^T / sqrt(D)) v over each image's T tokens."""
    b, t, heads, d = q.shape
    if k.shape != q.shape or v.shape != q.shape or any(x.stride(-1) != 1 for x in (q, k, v)):
        raise ValueError(f"vit_attention needs q, k, v of one shape with the head dim contiguous, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if d < 16 or any(x.data_ptr() % 16 or any(n % 8 for n in x.stride()[:3]) for x in (q, k, v)):
        raise ValueError(f"vit_attention needs head_dim >= 16 (the dots' smallest, got {d}), 16-byte aligned "
                         f"tensors and strides of 8 elements (the kernel's 16-byte loads)")
    da, db = head_parts(d)
    out = q.new_empty((b, t, heads * d))
    _vit_attention[(b * heads, triton.cdiv(t, block_m))](
        q, k, v, out, t, heads, LOG2E / math.sqrt(d), q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        D=d, DA=da, DB=db, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages)
    return out


@torch.library.custom_op("vla::vit_attention", mutates_args=())
def vit_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """vit_attention at its default tiles as one op a compiled region keeps whole (on the CPU the
    kernel itself, interpreted: TRITON_INTERPRET=1)."""
    return vit_attention(q, k, v)


@vit_attention_op.register_fake
def _(q, k, v):
    b, t, heads, d = q.shape
    return q.new_empty((b, t, heads * d))


def use_vit_attention_kernel(model: torch.nn.Module) -> int:
    """Every ViT block's attention through vit_attention_op; returns how many blocks."""
    from ...model.vision import ViTAttention
    blocks = [m for m in model.modules() if isinstance(m, ViTAttention)]
    for attention in blocks:
        attention.attend = vit_attention_op
    return len(blocks)
