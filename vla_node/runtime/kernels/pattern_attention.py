"""The LLM prefill's attention pattern in one Triton flash-attention kernel: query i (at position
q_offset + i) sees key j when j <= its position, or when both are image tokens. No [T, S] mask is
read, nothing is gathered or merged (the split it replaced ran the full prefill's pattern as two
causal cuDNN calls, a gather and a merge by their log-sum-exps; removed since).

Each query tile walks only the key tiles the pattern shows it, from small int32 tables built on the
device from the image flags (no host sync; `PatternAttention.refresh` rewrites them in place, so a
captured CUDA graph stays valid). For a query tile the key tiles fall in three ranges:
  - below its first position: every key visible to every query, no mask work;
  - from there to its last position (the diagonal): the predicate (j <= pos) | (img[pos] & img[j]);
  - past its last position: only key tiles holding image keys, and only for a tile holding image
    queries (visible = img[pos] & img[j]); the rest are skipped.
The tables keep, per query tile, its fully visible key tiles (the first range, and image x image
tiles anywhere) and then the ones that need the predicate, in key order; a tile whose every pair
is visible runs without it wherever it lies. Query tiles run heaviest first.

Online softmax in fp32 with exp2 (the scale folded with log2 e), dots in the inputs' dtype with
fp32 accumulation (fp32 inputs in full precision, not TF32). The output is written in the
[B, T, H, D] layout the output projection reads, so the layer's transpose + reshape is a view.
From sm_90 on (and under the interpreter), q, K and V come through tensor descriptors (the copy
engine's loads, keys past S and queries past T zero-filled): fewer registers and address
instructions than pointer loads; on older GPUs, or where a stride is no 16-byte multiple, by pointer.
`pattern_kernel`, from the `compile` rung on: on an H100 43.7 us a layer at DROID against the
compiled split's 79.9 (BENCHMARKS.md, twenty-second session), 41.7 with descriptors (twenty-ninth).
Runs on the CPU under TRITON_INTERPRET=1 (the CI tests).

An earlier pattern kernel (852e1dc, removed in b137094) lost to the split on the H200 (81.9 against
76.7 us at DROID, 269.9 against 174.9 at 8 images): it ran the predicate on every key tile from the
diagonal to the last image key, with bounds masks on every load. This one runs the predicate only
where a tile is partly visible.
"""
from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .few_query_attention import precise_dot

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tile(acc, m_i, l_i, q, K, V, Img, skt, svt, start, S, pos, img_q, qk_scale, kv_at,
                 D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """Keys start .. start + BLOCK_N - 1 into the online softmax state (acc, m_i [log2 units], l_i)
    of queries q at positions pos. A fully visible tile (all its keys < S) needs no mask; a MASKED
    one takes the pattern's predicate and reads no key past S (TMA: K and V are [B, KV, S, D] tensor
    descriptors, read at kv_at = (entry, head group), keys past S zero-filled by the copy engine, as Q's
    rows past T are)."""
    keys = start + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    if TMA:
        k = K.load([kv_at[0], kv_at[1], start, 0]).reshape(BLOCK_N, D)
        v = V.load([kv_at[0], kv_at[1], start, 0]).reshape(BLOCK_N, D)
        in_range = keys < S
    elif MASKED:
        in_range = keys < S
        k = tl.load(K + keys[:, None] * skt + d[None, :], mask=in_range[:, None], other=0.0)
        v = tl.load(V + keys[:, None] * svt + d[None, :], mask=in_range[:, None], other=0.0)
    else:
        k = tl.load(K + keys[:, None] * skt + d[None, :])
        v = tl.load(V + keys[:, None] * svt + d[None, :])
    s = precise_dot(q, tl.trans(k)) * qk_scale
    if MASKED:
        img_k = tl.load(Img + keys, mask=in_range, other=0) != 0
        s = tl.where((keys[None, :] <= pos[:, None]) | (img_q[:, None] & img_k[None, :]), s, float("-inf"))
    # m_new is finite: a query's first tile shows it a key (PatternAttention's table order)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.math.exp2(s - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = precise_dot(p.to(v.dtype), v, acc * alpha[:, None])
    return acc, m_new, l_i


@triton.jit
def _attend_tiles(acc, m_i, l_i, q, K, V, Img, Tiles, lo, hi, n_visible, start, skt, svt, S, pos, img_q, qk_scale,
                  kv_at, D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, TMA: tl.constexpr):
    """The key tiles Tiles[lo:hi] (start: the first one's first key). Each iteration reads the next
    tile's index ahead of its own loads: K and V addresses that come from the loop, not from a load
    in the same iteration, let Triton pipeline them (num_stages; compiled for sm_90 with Triton 3.9,
    a load of the iteration's own index left the loop unpipelined: 48 KB of shared memory at
    64x64 against 112 KB). Returns the state and the next tile's first key."""
    for i in range(lo, hi):
        following = tl.load(Tiles + i + 1, mask=i + 1 < n_visible, other=0) * BLOCK_N
        acc, m_i, l_i = _attend_tile(acc, m_i, l_i, q, K, V, Img, skt, svt, start, S, pos, img_q, qk_scale, kv_at,
                                     D, BLOCK_N, MASKED, TMA)
        start = following
    return acc, m_i, l_i, start


@triton.jit
def _norm_rope_rows(Q, row, sqt, W, Cos, Sin, sct, eps, D: tl.constexpr):
    """Query rows `row` of one head read straight from the q projection (Q at the head's first element),
    through the q norm and RoPE as kernels/rotary_heads makes them: RMSNorm with fp32 statistics,
    rounded to the input dtype, times the weight and rounded again (model.layers.RMSNorm), then
    rotate-half RoPE in fp32 with the tables' rows `row`, rounded to the input dtype. The rotated
    half of each element (its partner, D / 2 away) is a second load of the same rows."""
    d = tl.arange(0, D)
    partner = (d + D // 2) % D
    x = tl.load(Q + row[:, None] * sqt + d[None, :])
    x_partner = tl.load(Q + row[:, None] * sqt + partner[None, :])
    f, f_partner = x.to(tl.float32), x_partner.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(f * f, axis=1) / D + eps)[:, None]
    y = (tl.load(W + d).to(tl.float32)[None, :] * (f * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    y_partner = (tl.load(W + partner).to(tl.float32)[None, :]
                 * (f_partner * rstd).to(x.dtype).to(tl.float32)).to(x.dtype)
    cos = tl.load(Cos + row[:, None] * sct + d[None, :])
    sin = tl.load(Sin + row[:, None] * sct + d[None, :])
    sign = tl.where(d < D // 2, -1.0, 1.0)[None, :]
    return (y.to(tl.float32) * cos + sign * y_partner.to(tl.float32) * sin).to(x.dtype)


@triton.jit
def _pattern_attention(Q, K, V, Img, Tiles, Counts, Order, Out, T, S, q_offset, heads, group, qk_scale,
                       sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, n_key_tiles, QW, Cos, Sin, sct, eps,
                       D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, TMA: tl.constexpr,
                       ROPE_Q: tl.constexpr):
    bh = tl.program_id(0)                        # (entry, head) fastest: every head of a query tile together
    m = tl.load(Order + tl.program_id(1))        # the query tile, heaviest first
    b = (bh // heads).to(tl.int64)
    h = bh % heads
    rows = m * BLOCK_M + tl.arange(0, BLOCK_M)
    row = tl.minimum(rows, T - 1)                # rows past T repeat the last query (and are not stored)
    pos = q_offset + row
    d = tl.arange(0, D)
    if ROPE_Q:   # q is the projection's: its norm and RoPE here, once a program (by pointer)
        q = _norm_rope_rows(Q + b * sqb + h * sqh, row, sqt, QW, Cos, Sin, sct, eps, D)
    elif TMA:   # rows past T zero-filled (not stored; their positions repeat the last query's)
        q = Q.load([b.to(tl.int32), h, m * BLOCK_M, 0]).reshape(BLOCK_M, D)
    else:
        q = tl.load(Q + b * sqb + h * sqh + row[:, None] * sqt + d[None, :])
    img_q = tl.load(Img + pos) != 0
    kv_at = (b.to(tl.int32), h // group)
    if not TMA:
        K += b * skb + (h // group) * skh
        V += b * svb + (h // group) * svh
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    tiles = Tiles + m * n_key_tiles
    n_full = tl.load(Counts + 2 * m)
    n_visible = n_full + tl.load(Counts + 2 * m + 1)
    start = tl.load(tiles) * BLOCK_N
    acc, m_i, l_i, start = _attend_tiles(acc, m_i, l_i, q, K, V, Img, tiles, 0, n_full, n_visible, start, skt, svt, S,
                                         pos, img_q, qk_scale, kv_at, D, BLOCK_N, False, TMA)
    acc, m_i, l_i, start = _attend_tiles(acc, m_i, l_i, q, K, V, Img, tiles, n_full, n_visible, n_visible, start, skt,
                                         svt, S, pos, img_q, qk_scale, kv_at, D, BLOCK_N, True, TMA)
    out = acc / l_i[:, None]
    tl.store(Out + ((b * T + rows[:, None]) * heads + h) * D + d[None, :], out.to(Out.dtype.element_ty),
             mask=(rows < T)[:, None])


def pattern_mask(image_token: torch.Tensor, q_offset: int, q_len: int) -> torch.Tensor:
    """[q_len, S] bool: query i (position q_offset + i) sees key j when j <= its position or both
    are image tokens (image_token [S], bool or int8)."""
    img = image_token.bool()
    keys = torch.arange(img.numel(), device=img.device)
    pos = q_offset + torch.arange(q_len, device=img.device)
    return (keys[None, :] <= pos[:, None]) | (img[pos][:, None] & img[None, :])


def key_tiles(image_token: torch.Tensor, q_offset: int, q_len: int, block_m: int,
              block_n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's tables for image_token [S] on its device (no host sync): tiles [M, N] int32,
    each query tile's fully visible key tiles then those partly visible, in key order (the first
    of them shows every query a key: key 0, or a fully visible tile); counts [M, 2] int32, how many
    of each; order [M] int32, the query tiles by key tiles visited, most first."""
    kv_len = image_token.numel()
    n_m, n_n = triton.cdiv(q_len, block_m), triton.cdiv(kv_len, block_n)
    shown = torch.zeros((n_m * block_m, n_n * block_n), dtype=torch.bool, device=image_token.device)
    shown[:q_len, :kv_len] = pattern_mask(image_token, q_offset, q_len)
    shown[q_len:] = shown[q_len - 1]   # rows past the queries repeat the last one, as in the kernel
    tile = shown.view(n_m, block_m, n_n, block_n)
    full, some = tile.all(3).all(1), tile.any(3).any(1)   # keys past S count as hidden: no full tile holds one
    partial = some & ~full
    kind = torch.where(full, 0, torch.where(partial, 1, 2))
    tiles = (kind * n_n + torch.arange(n_n, device=kind.device)).argsort(1)
    counts = torch.stack((full.sum(1), partial.sum(1)), 1)
    order = some.sum(1).argsort(descending=True, stable=True)
    return tiles.to(torch.int32), counts.to(torch.int32), order.to(torch.int32)


@functools.cache
def _copy_engine_reads_descriptors(device: torch.device) -> bool:
    return device.type != "cuda" or torch.cuda.get_device_capability(device)[0] >= 9


def descriptors_fit(*xs: torch.Tensor) -> bool:
    """Whether the copy engine can read these [B, H, T, D] tensors through tensor descriptors: a GPU
    from sm_90 on (or no GPU: the interpreter, or meta tensors compiled for sm_90), 16-byte aligned,
    strides of 16-byte multiples."""
    return _copy_engine_reads_descriptors(xs[0].device) and not any(
        x.data_ptr() % 16 or any(n * x.element_size() % 16 for n in x.stride()[:-1]) for x in xs)


def pattern_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image: torch.Tensor, tiles: torch.Tensor,
                      counts: torch.Tensor, order: torch.Tensor, q_offset: int, block_m: int, block_n: int,
                      num_warps: int, num_stages: int, tma: bool = True,
                      q_rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
    """q [B, H, T, D], k/v [B, KV, S, D] (grouped heads; any strides, the head dim contiguous),
    image [S] int8 flags, the tables of key_tiles at these tiles -> y [B, T, H, D] contiguous.
    tma: K and V (and q) read through tensor descriptors where they fit (descriptors_fit), else by
    pointer. q_rope (the q norm's weight [D], cos and sin [T, D] fp32 with contiguous rows, its eps):
    q is the projection's, normed and rotated here as kernels/rotary_heads would (read by pointer)."""
    b, heads, t, d = q.shape
    kv_heads, s = k.shape[1], k.shape[2]
    if any(x.stride(-1) != 1 for x in (q, k, v)) or k.shape != v.shape or heads % kv_heads:
        raise ValueError("pattern_attention needs the head dim contiguous, k and v alike and whole head groups")
    if d < 16 or d & (d - 1) or image.numel() != s or tiles.shape != (triton.cdiv(t, block_m), triton.cdiv(s, block_n)):
        raise ValueError(f"pattern_attention: head_dim {d} (a power of two >= 16), {s} keys and {t} queries against "
                         f"flags of {image.numel()} and tables {tuple(tiles.shape)} at tiles {block_m}x{block_n}")
    tma = tma and descriptors_fit(k, v) and (q_rope is not None or descriptors_fit(q))
    out = q.new_empty((b, t, heads, d))
    qd, kd, vd = (q, k, v)
    if tma:
        kd, vd = (TensorDescriptor(x, list(x.shape), list(x.stride()), [1, 1, block_n, d]) for x in (k, v))
        if q_rope is None:
            qd = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, block_m, d])
    q_weight, cos, sin, eps = q_rope if q_rope is not None else (q, q, q, 0.0)   # unread without ROPE_Q
    if q_rope is not None and (cos.shape != (t, d) or cos.stride() != sin.stride() or cos.stride(-1) != 1):
        raise ValueError(f"pattern_attention: q_rope's tables must be [{t}, {d}] alike, rows contiguous")
    _pattern_attention[(b * heads, order.numel())](
        qd, kd, vd, image, tiles, counts, order, out, t, s, q_offset, heads, heads // kv_heads,
        LOG2E / math.sqrt(d),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), tiles.shape[1], q_weight, cos, sin, cos.stride(0), eps,
        D=d, BLOCK_M=block_m, BLOCK_N=block_n, TMA=tma, ROPE_Q=q_rope is not None, num_warps=num_warps,
        num_stages=num_stages)
    return out


@torch.library.custom_op("vla::pattern_attention", mutates_args=())
def pattern_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image: torch.Tensor,
                         tiles: torch.Tensor, counts: torch.Tensor, order: torch.Tensor, q_offset: int, block_m: int,
                         block_n: int, num_warps: int, num_stages: int, tma: bool, q_weight: Optional[torch.Tensor],
                         cos: Optional[torch.Tensor], sin: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """pattern_attention as one op a compiled region keeps whole (on the CPU the kernel itself,
    interpreted: TRITON_INTERPRET=1); q_weight given: q_rope = (q_weight, cos, sin, eps)."""
    return pattern_attention(q, k, v, image, tiles, counts, order, q_offset, block_m, block_n, num_warps, num_stages,
                             tma, None if q_weight is None else (q_weight, cos, sin, eps))


@pattern_attention_op.register_fake
def _(q, k, v, image, tiles, counts, order, q_offset, block_m, block_n, num_warps, num_stages, tma, q_weight, cos, sin,
      eps):
    b, heads, t, d = q.shape
    return q.new_empty((b, t, heads, d))


class PatternAttention:
    """The pattern over image_token [S] (on the device) for q_len queries from position q_offset
    (the full prefill: 0 and S; a streaming step: its new tokens over the whole cache), run by the
    kernel at the given tiles. refresh rewrites the flags and tables in place.

    Default tiles 64x64, 4 warps, 3 stages: the best of flex attention's tilings on the H200 at both
    prompts (71.6 against 78.3 us for 128x64 w8 s3 at DROID, BENCHMARKS.md), flex being the nearest
    kernel to this one that was timed; compiled for sm_90 (head_dim 128, bf16) it takes 112 KB of
    shared memory and 190 registers a thread, two programs a SM, and at DROID its tiles cover 1.14x
    the visible pairs (128x64: 1.22x). On an H100 the fastest of the three timed
    (scripts/bench_prefill_attention.py): 43.7 us at DROID, 145.3 at 8 images, against 48.2 / 163.2 for
    64x64 w4 s2 and 54.0 / 189.5 for 128x64 w8 s2. tma (q, K, V through tensor descriptors, where they
    fit): on an H100 41.7 us at DROID and 133.6 at 8 images against 43.7 / 144.1 by pointer, a compiled
    DROID decoder layer 355.8 against 359.9 us; Triton's warp specialisation of the key loop (one loop
    over every tile, the image flags as bits) was 2.2x slower and gave NaN at 3 stages (Triton 3.6;
    BENCHMARKS.md, twenty-ninth session)."""

    def __init__(self, image_token: torch.Tensor, q_offset: int = 0, q_len: int | None = None, block_m: int = 64,
                 block_n: int = 64, num_warps: int = 4, num_stages: int = 3, tma: bool = True):
        kv_len = image_token.numel()
        self.q_offset, self.q_len = q_offset, kv_len - q_offset if q_len is None else q_len
        if q_offset < 0 or self.q_len < 1 or q_offset + self.q_len > kv_len:
            raise ValueError(f"queries {q_offset} .. {q_offset + self.q_len - 1} must lie within the {kv_len} keys")
        if any(n < 16 or n & (n - 1) for n in (block_m, block_n)):
            raise ValueError(f"tiles must be powers of two >= 16 (tl.dot), got {block_m}x{block_n}")
        self.launch = (block_m, block_n, num_warps, num_stages, tma)
        # cos/sin [q_len, D] of the queries' positions, where the layers leave q's norm and RoPE to the
        # kernel (rotary_heads.attend_rotating_q; set by the bucket)
        self.rope_tables: Optional[tuple[torch.Tensor, torch.Tensor]] = None
        dev = image_token.device
        n_m, n_n = triton.cdiv(self.q_len, block_m), triton.cdiv(kv_len, block_n)
        self.image = torch.zeros(kv_len, dtype=torch.int8, device=dev)
        self.tiles = torch.zeros((n_m, n_n), dtype=torch.int32, device=dev)
        self.counts = torch.zeros((n_m, 2), dtype=torch.int32, device=dev)
        self.order = torch.zeros(n_m, dtype=torch.int32, device=dev)
        self.refresh(image_token)

    def refresh(self, image_token: torch.Tensor) -> None:
        """After image_token changed (same length): the same tensors, rewritten on the device."""
        self.image.copy_(image_token)
        fresh = key_tiles(image_token, self.q_offset, self.q_len, *self.launch[:2])
        for mine, new in zip((self.tiles, self.counts, self.order), fresh, strict=True):
            mine.copy_(new)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_rope: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]] = None) -> torch.Tensor:
        """q [B, H, q_len, D], k/v [B, KV, S, D] (grouped heads) -> [B, H, q_len, D], a view of
        [B, q_len, H, D]. q_rope: pattern_attention's (q the projection's, normed and rotated here)."""
        weight, cos, sin, eps = q_rope if q_rope is not None else (None, None, None, 0.0)
        return pattern_attention_op(q, k, v, self.image, self.tiles, self.counts, self.order, self.q_offset,
                                    *self.launch, weight, cos, sin, eps).transpose(1, 2)
