"""Attention for a few queries over many keys (the action expert: 16 action tokens attending to
~1650 context tokens, 360 times per query), split over the keys like flash-decoding.

Library kernels parallelise over (batch, head, query block): with 16 queries and 8 heads that
is 8 thread blocks on a 132-SM GPU, and each call took ~26 us on the H200. Here every head's
keys are cut into chunks, each chunk is one program (partial softmax statistics), and a second
kernel merges the chunks (skipped when one chunk holds every key, as in the expert's
16-token self-attention).

Exposed as the custom op `vla::few_query_attention` so torch.compile and CUDA graphs treat it as
one opaque call. Runs on the CPU under TRITON_INTERPRET=1 (the CI tests).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

KEYS_PER_PROGRAM = 128
BLOCK_N = 64


@triton.jit
def load_keys(K, V, Mask, skn, svn, start, hi, n_keys, offs_d, d_ok, BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """Keys start .. start + BLOCK_N - 1 (clipped to hi and n_keys) of one (batch, head): K and V
    [BLOCK_N, BLOCK_D] and which of them count [BLOCK_N] (in range, and unmasked when HAS_MASK)."""
    offs_n = start + tl.arange(0, BLOCK_N)
    n_ok = (offs_n < n_keys) & (offs_n < hi)  # hi need not be a multiple of BLOCK_N
    k = tl.load(K + offs_n[:, None] * skn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    v = tl.load(V + offs_n[:, None] * svn + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if HAS_MASK:
        n_ok = n_ok & (tl.load(Mask + offs_n, mask=n_ok, other=0) != 0)
    return k, v, n_ok


@triton.jit
def attend_chunk(q, k, v, n_ok, scale, acc, m_i, l_i):
    """One chunk of keys (load_keys) into the online softmax state (acc, m_i, l_i) of queries q.
    fp32 dots run in full precision: tl.dot's default for them is TF32 (10 mantissa bits), a
    deviation from eager that no lossless fp32 engine should carry (its share of the 4.5e-2 an fp32
    `fast` engine once had on the H200 was not told apart from the compiled attention's)."""
    s = precise_dot(q, tl.trans(k.to(q.dtype))) * scale
    s = tl.where(n_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a chunk with no valid key yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + precise_dot(p.to(q.dtype), v.to(q.dtype))
    return acc, m_new, l_i


@triton.jit
def precise_dot(a, b, acc=None):
    """tl.dot(a, b, acc), fp32 inputs in full precision (not TF32)."""
    if a.dtype == tl.float32:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def attend_keys(q, K, V, Mask, skn, svn, lo, hi, n_keys, scale, offs_d, d_ok, acc, m_i, l_i,
                BLOCK_N: tl.constexpr, HAS_MASK: tl.constexpr):
    """Online softmax of queries q [M, BLOCK_D] over keys lo..hi - 1 (clipped to n_keys) of one
    (batch, head), from the state (acc, m_i, l_i) (start: 0, -inf, 0): K, V point at its key 0,
    Mask at its mask entry 0 (bool, read when HAS_MASK). Returns (acc [M, BLOCK_D] fp32
    un-normalised, running max m [M], denominator l [M]); no valid key gives m = -inf, l = 0.
    Dots run in q's dtype."""
    for start in range(lo, hi, BLOCK_N):
        k, v, n_ok = load_keys(K, V, Mask, skn, svn, start, hi, n_keys, offs_d, d_ok, BLOCK_N, HAS_MASK)
        acc, m_i, l_i = attend_chunk(q, k, v, n_ok, scale, acc, m_i, l_i)
    return acc, m_i, l_i


@triton.jit
def softmax_start(M: tl.constexpr, BLOCK_D: tl.constexpr):
    """The online softmax state before any key: (acc, m, l)."""
    return (tl.zeros([M, BLOCK_D], tl.float32), tl.full([M], float("-inf"), tl.float32),
            tl.zeros([M], tl.float32))


@triton.jit
def merge_partials(OPart, MPart, LPart, row0, split_rows, offs_d, d_ok, SPLITS: tl.constexpr, BLOCK_D: tl.constexpr):
    """Softmax-weighted merge of split partials: split s of query m sits at row row0[m] + s *
    split_rows of MPart/LPart (and of OPart, rows of BLOCK_D); returns the normalised output
    [M, BLOCK_D]. One 2-D load per split, all splits unrolled so their loads are in flight
    together (a loop over 3-D groups of splits took 12.6 us for 16 queries on the H200). Loads
    go through L2 only (.cg): in a persistent kernel other programs wrote the partials, and an
    SM's L1 may hold older lines."""
    m_all = tl.load(MPart + row0[None, :] + tl.arange(0, SPLITS)[:, None] * split_rows, cache_modifier=".cg")
    m_max = tl.max(m_all, 0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    out = tl.zeros([row0.shape[0], BLOCK_D], tl.float32)
    denom = tl.zeros([row0.shape[0]], tl.float32)
    for s in tl.static_range(SPLITS):
        rows = row0 + s * split_rows
        w = tl.exp(tl.load(MPart + rows, cache_modifier=".cg") - m_max)  # 0 for a split without valid keys
        denom += w * tl.load(LPart + rows, cache_modifier=".cg")
        o = tl.load(OPart + rows[:, None] * BLOCK_D + offs_d[None, :], mask=d_ok[None, :], other=0.0,
                    cache_modifier=".cg")
        out += o * w[:, None]
    return out / tl.where(denom == 0, 1.0, denom)[:, None]


@triton.jit
def _partial(Q, K, V, Mask, OPart, MPart, LPart, Out, n_keys, heads, scale,
             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, smb, sob, soh, som,
             M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
             KEYS_PER_PROGRAM: tl.constexpr, HAS_MASK: tl.constexpr, DIRECT: tl.constexpr):
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqm + offs_d[None, :], mask=d_ok[None, :], other=0.0)
    acc, m_i, l_i = softmax_start(M, BLOCK_D)
    acc, m_i, l_i = attend_keys(q, K + b * skb + h * skh, V + b * svb + h * svh, Mask + b * smb, skn, svn,
                                split * KEYS_PER_PROGRAM, (split + 1) * KEYS_PER_PROGRAM, n_keys, scale,
                                offs_d, d_ok, acc, m_i, l_i, BLOCK_N, HAS_MASK)
    if DIRECT:  # one chunk holds every key: normalise and write the output, no merge pass
        tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :],
                 (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=d_ok[None, :])
    else:
        base = (bh * tl.num_programs(1) + split) * M
        tl.store(OPart + (base + offs_m[:, None]) * BLOCK_D + offs_d[None, :], acc)
        tl.store(MPart + base + offs_m, m_i)
        tl.store(LPart + base + offs_m, l_i)


@triton.jit
def _merge(OPart, MPart, LPart, Out, heads, sob, soh, som,
           SPLITS: tl.constexpr, M: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr):
    bh = tl.program_id(0)
    b = bh // heads
    h = bh % heads
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, BLOCK_D)
    out = merge_partials(OPart, MPart, LPart, bh * SPLITS * M + offs_m, M, offs_d, offs_d < D, SPLITS, BLOCK_D)
    tl.store(Out + b * sob + h * soh + offs_m[:, None] * som + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=(offs_d < D)[None, :])


@torch.library.custom_op("vla::few_query_attention", mutates_args=())
def few_query_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           mask: Optional[torch.Tensor]) -> torch.Tensor:
    b, heads, m, d = q.shape
    n_keys = k.shape[2]
    splits = triton.next_power_of_2(triton.cdiv(n_keys, KEYS_PER_PROGRAM))
    block_d = triton.next_power_of_2(d)
    direct = splits == 1
    parts = 1 if direct else b * heads * splits * m  # no partials when one chunk covers every key
    opart = torch.empty((parts, block_d), dtype=torch.float32, device=q.device)
    mpart = torch.empty((parts,), dtype=torch.float32, device=q.device)
    lpart = torch.empty_like(mpart)
    out = torch.empty((b, m, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, M, D] view
    mask_arg = mask.reshape(mask.shape[0], -1) if mask is not None else q  # any pointer when unused
    _partial[(b * heads, splits)](
        q, k, v, mask_arg, opart, mpart, lpart, out, n_keys, heads, 1.0 / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask_arg.stride(0) if mask is not None and mask.shape[0] > 1 else 0,
        out.stride(0), out.stride(1), out.stride(2),
        M=m, D=d, BLOCK_D=block_d, BLOCK_N=BLOCK_N, KEYS_PER_PROGRAM=KEYS_PER_PROGRAM, HAS_MASK=mask is not None,
        DIRECT=direct)
    if not direct:
        _merge[(b * heads,)](opart, mpart, lpart, out, heads, out.stride(0), out.stride(1), out.stride(2),
                             SPLITS=splits, M=m, D=d, BLOCK_D=block_d)
    return out


@few_query_attention_op.register_fake
def _(q, k, v, mask):
    b, heads, m, d = q.shape
    return torch.empty((b, m, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)


def few_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        attn_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Drop-in for F.scaled_dot_product_attention(q, k, v, attn_mask) with q, k, v [B, H, *, D]
    (last dim contiguous), a boolean key mask broadcastable to [B, 1, 1, N], and 16 <= queries
    (a power of two) - the action expert's shapes."""
    if q.shape[2] < 16 or q.shape[2] & (q.shape[2] - 1):
        raise ValueError(f"few_query_attention needs a power-of-two number of queries >= 16, got {q.shape[2]}")
    return few_query_attention_op(q, k, v, attn_mask)
