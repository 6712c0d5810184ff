"""Triton kernels for the action expert's blocks at a few rows (16 action tokens per query).

On the H200 every kernel costs ~2.5-3 us of latency inside a CUDA graph however few bytes it
reads, and a block reads only ~16.5 MB of weights (~3.8 us at 4.3 TB/s), so a block is 6
launches here instead of ~14 (x is the fp32 residual stream [M, w], M = batch * horizon):

    qkv        linear_kernel           LN1 + modulate -> x W^T + b                      -> QKV
    self_out   head_linear_kernel      self-attention of head s -> y W^T (split s), x += g1 (. + b)
    cross      cross_attention_kernel  LN2 + modulate -> q of head h; keys split s      -> partials
    cross_out  head_linear_kernel      merge of head s's partials -> y W^T (split s),  x += g2 (. + b)
    fc1        linear_kernel           LN3 + modulate -> GELU(x W^T + b)                -> HID
    fc2        linear_kernel           HID W^T (split over K),                         x += g3 (. + b)

A linear runs BLOCK_N output channels per program (many programs over N) and optionally splits
K; each split stores its partial tile, and the last split to arrive (an atomic counter per tile)
sums them in split order and runs the epilogue, so results do not depend on arrival order
(unlike atomic adds: graph replays stay bit-identical). The programs of one tile read disjoint
weights, and only the last one touches the residual, so the stream is updated in place.

Weights are read in nn.Linear layout [N, K] (bf16/fp32, or e4m3 with an fp32 scale per output
channel, dequantised in the kernel). Dots run in DOT (bf16 on the GPU; fp32 under
TRITON_INTERPRET, whose bf16 dots are wrong). With PREFETCH a program first asks L2 for the
weight (and key) lines it will read, so their DRAM latency overlaps the prologue; with USE_PDL
(Hopper programmatic dependent launch) it does so, lets the next kernel launch and only then
waits for the previous one, so weight traffic also overlaps the previous kernel's tail.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .few_query_attention import attend_keys, merge_partials

INV_SQRT2 = tl.constexpr(0.7071067811865476)  # a jit function reads only constexpr globals


@triton.jit
def _prefetch_l2(ptrs):
    """Bring the lines at ptrs into L2. Safe before gdc_wait: L2 is coherent and nothing lands
    in registers."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs],
                              dtype=tl.int32, is_pure=False, pack=1)


@triton.jit
def _prefetch_rows(Base, rows, row_ok, stride, cols, LINE: tl.constexpr, LINES: tl.constexpr):
    """L2 prefetch of `cols` elements of each row (one address per 128-byte line of LINE elements)."""
    offs = tl.arange(0, LINES) * LINE
    ok = row_ok[:, None] & (offs < cols)[None, :]
    _prefetch_l2(tl.where(ok, Base + rows[:, None] * stride + offs[None, :], Base))


@triton.jit
def _row_stats(X, sxm, rows, row_ok, K, eps, BLOCK_K: tl.constexpr, K_CHUNKS: tl.constexpr):
    """LayerNorm mean and 1/std [BLOCK_M] of rows of X [M, K]. One pass in K_CHUNKS unrolled
    chunks (loads in flight together; a loop would serialise them), shifted by each row's
    first value so the variance does not cancel."""
    shift = tl.load(X + rows * sxm, mask=row_ok, other=0.0).to(tl.float32)
    s1 = tl.zeros_like(shift)
    s2 = tl.zeros_like(shift)
    for c in tl.static_range(K_CHUNKS):
        offs_k = c * BLOCK_K + tl.arange(0, BLOCK_K)
        ok = row_ok[:, None] & (offs_k < K)[None, :]
        d = tl.load(X + rows[:, None] * sxm + offs_k[None, :], mask=ok, other=0.0).to(tl.float32) - shift[:, None]
        d = tl.where(ok, d, 0.0)
        s1 += tl.sum(d, 1)
        s2 += tl.sum(d * d, 1)
    mean_d = s1 / K
    return shift + mean_d, tl.rsqrt(tl.maximum(s2 / K - mean_d * mean_d, 0.0) + eps)


@triton.jit
def _ln_modulate(X, sxm, rows, row_ok, offs_k, k_ok, mean, rstd, Mod, mod_rows, shift_off, scale_off,
                 PER_ROW: tl.constexpr):
    """A chunk [BLOCK_M, BLOCK_K] of LayerNorm(x) * (1 + scale) + shift; shift/scale at those
    offsets of the modulation vector at Mod (PER_ROW: at Mod + mod_rows, one per row, which
    costs registers); 0 outside the matrix."""
    ok = row_ok[:, None] & k_ok[None, :]
    x = tl.load(X + rows[:, None] * sxm + offs_k[None, :], mask=ok, other=0.0).to(tl.float32)
    if PER_ROW:
        m = Mod + mod_rows[:, None] + offs_k[None, :]
        shift = tl.load(m + shift_off, mask=ok, other=0.0).to(tl.float32)
        scale = tl.load(m + scale_off, mask=ok, other=0.0).to(tl.float32)
    else:
        shift = tl.load(Mod + shift_off + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
        scale = tl.load(Mod + scale_off + offs_k, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return tl.where(ok, (x - mean[:, None]) * rstd[:, None] * (1.0 + scale) + shift, 0.0)


@triton.jit
def _reduce_splits(acc, Part, Counter, tile, split, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr):
    """Deterministic split-K: store this split's tile, count arrivals; the last arrival gets the
    sum of all splits in split order (and re-zeroes the counter). Returns (sum, is_last)."""
    offs = tl.arange(0, BLOCK_M)[:, None] * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    tl.store(Part + (tile * SPLITS + split) * (BLOCK_M * BLOCK_N) + offs, acc)
    tl.debug_barrier()  # every thread's share of the tile is written before the program arrives
    last = tl.atomic_add(Counter + tile, 1, sem="acq_rel") == SPLITS - 1
    if last:
        acc = tl.zeros_like(acc)
        for s in tl.static_range(SPLITS):  # .cg: other SMs wrote these; skip L1
            acc += tl.load(Part + (tile * SPLITS + s) * (BLOCK_M * BLOCK_N) + offs, cache_modifier=".cg")
        tl.store(Counter + tile, 0)
    return acc, last


@triton.jit
def _epilogue(acc, rows, row_ok, offs_n, n_ok, Out, som, Bias, WScale, Res, srm, res_period, Mod, mod_rows,
              gate_off, SCALED: tl.constexpr, GELU: tl.constexpr, GATED: tl.constexpr, RESIDUAL: tl.constexpr):
    """out = res[row % res_period] + gate * act(acc * w_scale + bias), each part optional but the bias."""
    ok = row_ok[:, None] & n_ok[None, :]
    if SCALED:
        acc = acc * tl.load(WScale + offs_n, mask=n_ok, other=0.0)[None, :]
    y = acc + tl.load(Bias + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if GELU:  # exact (erf) GELU, as nn.functional.gelu
        y = 0.5 * y * (1.0 + tl.math.erf(y * INV_SQRT2))
    if GATED:
        y = y * tl.load(Mod + mod_rows[:, None] + gate_off + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    if RESIDUAL:
        y = y + tl.load(Res + (rows % res_period)[:, None] * srm + offs_n[None, :], mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + rows[:, None] * som + offs_n[None, :], y.to(Out.dtype.element_ty), mask=ok)


@triton.jit
def linear_kernel(X, sxm, W, swn, WScale, Bias, Out, som, Res, srm, res_period, Mod, smb, shift_off, scale_off,
                  gate_off, Part, Counter, M, N, K, k_per_split, tokens, eps,
                  NORM: tl.constexpr, MOD_PER_ROW: tl.constexpr, GELU: tl.constexpr, GATED: tl.constexpr,
                  RESIDUAL: tl.constexpr, SCALED: tl.constexpr, SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, STATS_K: tl.constexpr, STATS_CHUNKS: tl.constexpr,
                  DOT: tl.constexpr, PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, LINE: tl.constexpr,
                  LINES: tl.constexpr):
    """Out [M, N] = epilogue(prologue(X [M, K]) @ W[N, K]^T). Grid (N / BLOCK_N, SPLITS); the
    prologue is modulate(LayerNorm(x)) when NORM (stats over all of K), else x as it is."""
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    mod_rows = (rows // tokens) * smb
    k_lo = split * k_per_split
    if PREFETCH:  # weight lines start coming from DRAM while the statistics are computed
        _prefetch_rows(W + k_lo, offs_n, n_ok, swn, k_per_split, LINE, LINES)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if NORM:
        mean, rstd = _row_stats(X, sxm, rows, row_ok, K, eps, STATS_K, STATS_CHUNKS)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_lo + k_per_split, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < K
        if NORM:
            a = _ln_modulate(X, sxm, rows, row_ok, offs_k, k_ok, mean, rstd, Mod, mod_rows, shift_off, scale_off,
                             MOD_PER_ROW)
        else:
            a = tl.load(X + rows[:, None] * sxm + offs_k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(W + offs_n[:, None] * swn + offs_k[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(a.to(DOT), tl.trans(w.to(DOT)))
    if SPLITS > 1:
        acc, last = _reduce_splits(acc, Part, Counter, pid_n, split, SPLITS, BLOCK_M, BLOCK_N)
        if last:
            _epilogue(acc, rows, row_ok, offs_n, n_ok, Out, som, Bias, WScale, Res, srm, res_period, Mod, mod_rows,
                      gate_off, SCALED, GELU, GATED, RESIDUAL)
    else:
        _epilogue(acc, rows, row_ok, offs_n, n_ok, Out, som, Bias, WScale, Res, srm, res_period, Mod, mod_rows,
                  gate_off, SCALED, GELU, GATED, RESIDUAL)


@triton.jit
def _self_attention(QKV, sqm, rows, row_ok, tokens, col, width, scale, offs_d, d_ok, DOT: tl.constexpr):
    """Softmax attention of one head (q/k/v at columns col, width + col, 2 width + col of the
    fused q/k/v rows) among the rows of the same batch entry: y [BLOCK_M, BLOCK_D] fp32."""
    ok = row_ok[:, None] & d_ok[None, :]
    base = QKV + rows[:, None] * sqm + col + offs_d[None, :]
    q = tl.load(base, mask=ok, other=0.0)
    k = tl.load(base + width, mask=ok, other=0.0)
    v = tl.load(base + 2 * width, mask=ok, other=0.0)
    s = tl.dot(q.to(DOT), tl.trans(k.to(DOT))) * scale
    same = ((rows // tokens)[:, None] == (rows // tokens)[None, :]) & row_ok[None, :]
    s = tl.where(same, s, float("-inf"))
    m = tl.max(s, 1)
    p = tl.exp(s - tl.where(m == float("-inf"), 0.0, m)[:, None])
    l = tl.sum(p, 1)
    return tl.dot(p.to(DOT), v.to(DOT)) / tl.where(l == 0, 1.0, l)[:, None]


@triton.jit
def head_linear_kernel(Src, ssm, OPart, MPart, LPart, W, swn, WScale, Bias, X, sxm, Mod, smb, gate_off,
                       Part, Counter, M, N, tokens, width, heads, scale,
                       ATTEND: tl.constexpr, D: tl.constexpr, HEADS: tl.constexpr, KEY_SPLITS: tl.constexpr,
                       BLOCK_H: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_D: tl.constexpr, DOT: tl.constexpr, USE_PDL: tl.constexpr):
    """x [M, N] += gate * (y @ W[N, width]^T + b), split over K by head: program (n, h) makes
    head h's y [M, D] itself - its self-attention from the fused q/k/v rows Src [M, 3 width]
    (ATTEND), or the merge of its cross-attention partials (OPart/MPart/LPart) - then
    multiplies it by W's columns of that head."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < M
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    # The weights first (constant, so safe before gdc_wait): their latency overlaps the prologue.
    w = tl.load(W + offs_n[:, None] * swn + h * D + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if ATTEND:
        y = _self_attention(Src, ssm, rows, row_ok, tokens, h * D, width, scale, offs_d, d_ok, DOT)
    else:  # partial rows of (batch entry, head, key split) hold BLOCK_H tokens each
        row0 = ((rows // tokens) * heads + h) * KEY_SPLITS * BLOCK_H + rows % tokens
        y = merge_partials(OPart, MPart, LPart, tl.where(row_ok, row0, 0), BLOCK_H, offs_d, d_ok, KEY_SPLITS, BLOCK_D)
    acc = tl.dot(y.to(DOT), tl.trans(w.to(DOT)))
    acc, last = _reduce_splits(acc, Part, Counter, pid_n, h, HEADS, BLOCK_M, BLOCK_N)
    if last:
        _epilogue(acc, rows, row_ok, offs_n, n_ok, X, sxm, Bias, WScale, X, sxm, M, Mod, (rows // tokens) * smb,
                  gate_off, SCALED, False, True, True)


@triton.jit
def cross_attention_kernel(X, sxm, Wq, swq, WqScale, Bq, Mod, smb, shift_off, scale_off, K, V, Mask,
                           OPart, MPart, LPart, tokens, width, heads, n_keys, keys_per_split, eps, scale,
                           skb, skh, skn, svb, svh, svn, smask,
                           PROJECT: tl.constexpr, SCALED: tl.constexpr, HAS_MASK: tl.constexpr, D: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                           STATS_K: tl.constexpr, STATS_CHUNKS: tl.constexpr, BLOCK_KEYS: tl.constexpr,
                           DOT: tl.constexpr,
                           PREFETCH: tl.constexpr, USE_PDL: tl.constexpr, LINE: tl.constexpr, LINES: tl.constexpr,
                           KV_LINE: tl.constexpr, KV_LINES: tl.constexpr):
    """Flash-decoding partials of the cross-attention, program (batch entry * heads + h, split):
    queries of head h over keys split * keys_per_split ... (+ keys_per_split). With PROJECT the
    program makes its queries itself, modulate(LayerNorm(x)) @ Wq[h rows]^T + bq from the
    residual X [M, width]; else X holds the queries [M, width]. Partials: OPart
    [entries * heads, splits, BLOCK_H, BLOCK_D] (un-normalised), MPart/LPart [.., BLOCK_H]."""
    bh = tl.program_id(0)
    split = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    offs_i = tl.arange(0, BLOCK_H)
    row_ok = offs_i < tokens
    rows = b * tokens + offs_i
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    Kb = K + b * skb + h * skh
    Vb = V + b * svb + h * svh
    lo = split * keys_per_split
    if PREFETCH:  # keys and values arrive while the queries are made
        if PROJECT:
            _prefetch_rows(Wq, h * D + offs_d, d_ok, swq, width, LINE, LINES)
        keys = lo + tl.arange(0, BLOCK_KEYS)
        for k0 in range(0, keys_per_split, BLOCK_KEYS):
            _prefetch_rows(Kb, keys + k0, keys + k0 < n_keys, skn, D, KV_LINE, KV_LINES)
            _prefetch_rows(Vb, keys + k0, keys + k0 < n_keys, svn, D, KV_LINE, KV_LINES)
    if USE_PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()
    if PROJECT:
        mean, rstd = _row_stats(X, sxm, rows, row_ok, width, eps, STATS_K, STATS_CHUNKS)
        q = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_ok = offs_k < width
            a = _ln_modulate(X, sxm, rows, row_ok, offs_k, k_ok, mean, rstd, Mod + b * smb, rows, shift_off,
                             scale_off, False)
            w = tl.load(Wq + (h * D + offs_d)[:, None] * swq + offs_k[None, :], mask=d_ok[:, None] & k_ok[None, :],
                        other=0.0)
            q += tl.dot(a.to(DOT), tl.trans(w.to(DOT)))
        if SCALED:
            q = q * tl.load(WqScale + h * D + offs_d, mask=d_ok, other=0.0)[None, :]
        q += tl.load(Bq + h * D + offs_d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
    else:
        q = tl.load(X + rows[:, None] * sxm + h * D + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = tl.where(row_ok[:, None] & d_ok[None, :], q, 0.0).to(DOT)
    acc, m_i, l_i = attend_keys(q, Kb, Vb, Mask + b * smask, skn, svn, lo, lo + keys_per_split, n_keys, scale,
                                offs_d, d_ok, BLOCK_KEYS, HAS_MASK)
    base = (bh * tl.num_programs(1) + split) * BLOCK_H
    tl.store(OPart + (base + offs_i)[:, None] * BLOCK_D + offs_d[None, :], acc, mask=d_ok[None, :])
    tl.store(MPart + base + offs_i, m_i)
    tl.store(LPart + base + offs_i, l_i)


# -- launchers ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Tiling:
    """Tile sizes. Defaults for the full expert on the H200: enough programs per linear to pull
    weights on every SM (qkv 144, fc1 192, fc2 48 x 4 splits), tiles the software pipeliner
    keeps in flight."""
    block_n: int = 16          # output channels per program of a linear
    block_k: int = 128         # K per loop step (256: fc2 spills registers)
    head_block_n: int = 32     # output channels per program of self_out / cross_out
    keys_per_split: int = 256  # cross-attention keys per program (a multiple of block_keys)
    block_keys: int = 64
    min_programs: int = 128    # split K (by powers of two) until a linear has this many programs
    num_warps: int = 4
    num_stages: int = 3
    prefetch_l2: bool = True   # each program first asks L2 for its weight (and key) lines (GPU only)


@dataclass
class SplitScratch:
    """Partial tiles (fp32) and per-tile arrival counters (int32, left at zero by every kernel)
    for split-K. Launches in one stream run one after another, so they can share it."""
    part: torch.Tensor
    counter: torch.Tensor

    @classmethod
    def create(cls, tiles: int, floats: int, device) -> "SplitScratch":
        return cls(torch.empty(floats, dtype=torch.float32, device=device),
                   torch.zeros(tiles, dtype=torch.int32, device=device))

    def check(self, tiles: int, floats: int) -> None:
        if tiles > self.counter.numel() or floats > self.part.numel():
            raise ValueError(f"split scratch too small: needs {tiles} tiles / {floats} floats")


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def dot_dtype(compute: torch.dtype):
    """Dot operand type for a model dtype: fp32 under the interpreter (its bf16 dots are wrong)."""
    if interpreting() or compute == torch.float32:
        return tl.float32
    return {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[compute]


def block_rows(m: int) -> int:
    if m > 64:
        raise ValueError(f"the expert kernels take at most 64 rows (batch * horizon), got {m}")
    return max(16, triton.next_power_of_2(m))


def _block_k(k: int, tiling: Tiling) -> int:
    return max(16, min(tiling.block_k, triton.next_power_of_2(k)))  # tl.dot needs K >= 16


def linear_splits(n: int, k: int, tiling: Tiling) -> int:
    """K splits of a linear: double while it has too few programs and K divides evenly."""
    tiles, block_k, splits = triton.cdiv(n, tiling.block_n), _block_k(k, tiling), 1
    while tiles * splits < tiling.min_programs and k % (2 * splits * block_k) == 0:
        splits *= 2
    return splits


def _prefetch_lines(weight: torch.Tensor, cols: int) -> tuple[int, int]:
    line = 128 // weight.element_size()
    return line, triton.next_power_of_2(triton.cdiv(cols, line))


def _stats_chunks(k: int) -> dict:
    """LayerNorm statistics in chunks of <= 256 columns: more, smaller chunks spill registers."""
    stats_k = max(16, min(256, triton.next_power_of_2(k)))
    return dict(STATS_K=stats_k, STATS_CHUNKS=triton.cdiv(k, stats_k))


def _prefetch(tiling: Tiling) -> bool:
    return tiling.prefetch_l2 and not interpreting()  # the interpreter cannot run inline PTX


def _launch_options(tiling: Tiling, pdl: bool) -> dict:
    options = dict(num_warps=tiling.num_warps, num_stages=tiling.num_stages)
    if pdl:
        options["launch_pdl"] = True
    return options


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, out: torch.Tensor, scratch: SplitScratch, *,
           compute: torch.dtype, weight_scale: Optional[torch.Tensor] = None, mod: Optional[torch.Tensor] = None,
           norm: Optional[tuple[int, int]] = None, gate: Optional[int] = None, gelu: bool = False,
           residual: Optional[torch.Tensor] = None, tokens: Optional[int] = None, eps: float = 1e-6,
           tiling: Tiling = Tiling(), pdl: bool = False) -> torch.Tensor:
    """out [M, N] = residual[row % R] + mod[entry, gate:] * act(pre(x) @ weight^T * weight_scale + bias)

    x [M, K] rows of `tokens`-row batch entries (last dim contiguous); weight [N, K] (e4m3 with
    weight_scale [N] fp32, or the compute dtype); mod [entries|1, C] modulation vectors; pre(x) =
    LayerNorm(x) * (1 + mod[:, scale:]) + mod[:, shift:] with norm = (shift, scale) offsets, else
    x; act = exact GELU or identity; residual [R, N] (R = M or the rows of a period); out [M, N]
    may be the residual itself (updated in place)."""
    m, k = x.shape
    n = weight.shape[0]
    tokens = tokens or m
    splits = linear_splits(n, k, tiling)
    block_m, block_k = block_rows(m), _block_k(k, tiling)
    tiles = triton.cdiv(n, tiling.block_n)
    if splits > 1:
        scratch.check(tiles, tiles * splits * block_m * tiling.block_n)
    mod_arg = mod if mod is not None else x
    res_arg = residual if residual is not None else out
    line, lines = _prefetch_lines(weight, k // splits)
    linear_kernel[(tiles, splits)](
        x, x.stride(0), weight, weight.stride(0), weight_scale if weight_scale is not None else bias, bias,
        out, out.stride(0), res_arg, res_arg.stride(0), res_arg.shape[0], mod_arg,
        mod_arg.stride(0) if mod is not None and mod.shape[0] > 1 else 0, norm[0] if norm else 0,
        norm[1] if norm else 0, gate or 0, scratch.part, scratch.counter, m, n, k, k // splits, tokens, eps,
        NORM=norm is not None, MOD_PER_ROW=mod is not None and mod.shape[0] > 1 and m > tokens, GELU=gelu,
        GATED=gate is not None, RESIDUAL=residual is not None, SCALED=weight_scale is not None, SPLITS=splits,
        BLOCK_M=block_m, BLOCK_N=tiling.block_n, BLOCK_K=block_k, **_stats_chunks(k), DOT=dot_dtype(compute),
        PREFETCH=_prefetch(tiling), USE_PDL=pdl, LINE=line, LINES=lines, **_launch_options(tiling, pdl))
    return out


def head_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, mod: torch.Tensor, gate: int,
                scratch: SplitScratch, *, heads: int, tokens: int, compute: torch.dtype,
                qkv: Optional[torch.Tensor] = None, partials: Optional[tuple[torch.Tensor, ...]] = None,
                weight_scale: Optional[torch.Tensor] = None, tiling: Tiling = Tiling(), pdl: bool = False) -> None:
    """x [M, w] += mod[entry, gate:] * (y @ weight^T * weight_scale + bias), in place, where y
    [M, w] (head-major columns) is the self-attention of the fused q/k/v rows qkv [M, 3w] over
    the rows of each batch entry, or the merged cross-attention partials = (o, m, l) of
    cross_attention()."""
    m, width = x.shape
    n, d = weight.shape[0], width // heads
    block_m, block_d = block_rows(m), triton.next_power_of_2(d)
    tiles = triton.cdiv(n, tiling.head_block_n)
    scratch.check(tiles, tiles * heads * block_m * tiling.head_block_n)
    attend = qkv is not None
    o, mp, lp = partials if partials is not None else (x, x, x)
    head_linear_kernel[(tiles, heads)](
        qkv if attend else x, qkv.stride(0) if attend else 0, o, mp, lp, weight, weight.stride(0),
        weight_scale if weight_scale is not None else bias, bias, x, x.stride(0), mod,
        mod.stride(0) if mod.shape[0] > 1 else 0, gate, scratch.part, scratch.counter, m, n, tokens, width, heads,
        1.0 / math.sqrt(d), ATTEND=attend, D=d, HEADS=heads, KEY_SPLITS=1 if attend else o.shape[1],
        BLOCK_H=1 if attend else o.shape[2], SCALED=weight_scale is not None, BLOCK_M=block_m,
        BLOCK_N=tiling.head_block_n, BLOCK_D=block_d, DOT=dot_dtype(compute), USE_PDL=pdl,
        **_launch_options(tiling, pdl))


def key_splits(n_keys: int, tiling: Tiling) -> int:
    """Programs per (batch entry, head) of the cross-attention (a power of two: the merge loads
    all splits at once)."""
    if tiling.keys_per_split % tiling.block_keys:
        raise ValueError("keys_per_split must be a multiple of block_keys")
    return triton.next_power_of_2(triton.cdiv(n_keys, tiling.keys_per_split))


def cross_partials(entries: int, heads: int, tokens: int, head_dim: int, n_keys: int, tiling: Tiling,
                   device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Buffers for cross_attention(): o [entries * heads, splits, BLOCK_H, BLOCK_D], m and l [.., BLOCK_H]."""
    shape = (entries * heads, key_splits(n_keys, tiling), block_rows(tokens))
    o = torch.empty((*shape, triton.next_power_of_2(head_dim)), dtype=torch.float32, device=device)
    return o, torch.empty(shape, dtype=torch.float32, device=device), torch.empty(shape, dtype=torch.float32,
                                                                                   device=device)


def cross_attention(x: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                    partials: tuple[torch.Tensor, ...], *, tokens: int, compute: torch.dtype,
                    q_weight: Optional[torch.Tensor] = None, q_bias: Optional[torch.Tensor] = None,
                    q_scale: Optional[torch.Tensor] = None, mod: Optional[torch.Tensor] = None,
                    norm: tuple[int, int] = (0, 0), eps: float = 1e-6, tiling: Tiling = Tiling(),
                    pdl: bool = False) -> None:
    """Fill `partials` (cross_partials()) with the split cross-attention of the queries over
    k, v [entries, heads, T, D] (last dim contiguous) and a bool key mask [entries|1, T]. The
    queries are x [M, w] itself, or, given q_weight [w, w], LayerNorm(x) * (1 + mod[:, scale:])
    + mod[:, shift:] projected by it (q_bias, e4m3 q_scale) inside the kernel."""
    m, width = x.shape
    entries, heads, n_keys, d = k.shape
    o, mp, lp = partials
    project = q_weight is not None
    # The query projection's weight tile is [BLOCK_D, block_k]: at most 8K elements in registers.
    block_k = min(_block_k(width, tiling), max(16, 8192 // o.shape[3]))
    mask_arg = mask if mask is not None else x
    wq = q_weight if project else x
    line, lines = _prefetch_lines(wq, width)
    kv_line, kv_lines = _prefetch_lines(k, d)
    cross_attention_kernel[(entries * heads, o.shape[1])](
        x, x.stride(0), wq, wq.stride(0), q_scale if q_scale is not None else x, q_bias if project else x,
        mod if mod is not None else x, mod.stride(0) if mod is not None and mod.shape[0] > 1 else 0, norm[0],
        norm[1], k, v, mask_arg, o, mp, lp, tokens, width, heads, n_keys, tiling.keys_per_split, eps,
        1.0 / math.sqrt(d), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        mask.stride(0) if mask is not None and mask.shape[0] > 1 else 0,
        PROJECT=project, SCALED=q_scale is not None, HAS_MASK=mask is not None, D=d, BLOCK_H=o.shape[2],
        BLOCK_D=o.shape[3], BLOCK_K=block_k, **_stats_chunks(width), BLOCK_KEYS=tiling.block_keys,
        DOT=dot_dtype(compute), PREFETCH=_prefetch(tiling), USE_PDL=pdl, LINE=line, LINES=lines, KV_LINE=kv_line,
        KV_LINES=kv_lines,
        **_launch_options(tiling, pdl))
