"""The LLM prefill's attention pattern (causal, plus image tokens seeing each other both ways)
through flex attention with a block mask, instead of SDPA with a dense [T, S] boolean mask (which
CUDA runs with the memory-efficient kernel, reading the mask for every block, and the CPU with
the math kernel). Blocks that the pattern leaves fully visible or fully hidden skip the mask
entirely; compiled (the `compile` rung), flex attention becomes one Triton kernel per call.
The full prefill (every token of the bucket, from the first) can instead run the pattern as two
maskless causal calls (SplitPattern, `split_attention`) or as one Triton flash-attention kernel that
computes the pattern from the image flags (PatternKernel, `pattern_attention`); the streaming step
keeps flex.

`block_mask` builds the mask once per bucket (lengths fixed); `refresh_` rebuilds it in place, so
CUDA graphs that captured it keep reading the right tensors.
"""
from __future__ import annotations

import math
from typing import Optional, Union

import torch
import triton
import triton.language as tl
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ...model.llm import sdpa_attend
from .few_query_attention import attend_chunk, attend_keys, load_keys, softmax_start

_INDEX_FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices", "q_num_blocks", "q_indices",
                 "full_q_num_blocks", "full_q_indices")


def block_mask(image_token: torch.Tensor, q_offset: int, q_len: int, kv_len: int) -> BlockMask:
    """Query i (at position q_offset + i) may attend to key j when j <= its position, or when
    both are image tokens. image_token [>= kv_len] bool on the device (False past the prompt)."""
    img = image_token

    def visible(b, h, q_idx, kv_idx):
        pos = q_idx + q_offset
        return (kv_idx <= pos) | (img[pos] & img[kv_idx])

    return create_block_mask(visible, B=None, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=img.device)


def refresh_(mask: BlockMask, image_token: torch.Tensor, q_offset: int) -> None:
    """Rebuild `mask` in place after `image_token` changed (same lengths, same tensors)."""
    new = block_mask(image_token, q_offset, mask.seq_lengths[0], mask.seq_lengths[1])
    for field in _INDEX_FIELDS:
        old, fresh = getattr(mask, field), getattr(new, field)
        if old is not None:
            old.copy_(fresh)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[Union[BlockMask, "SplitPattern", torch.Tensor]]) -> torch.Tensor:
    """Drop-in for llm.sdpa_attend that runs flex attention when given a BlockMask (the split
    pattern's two calls when given a SplitPattern, the pattern kernel when given a PatternKernel)."""
    if isinstance(mask, (SplitPattern, PatternKernel)):
        return mask.attend(q, k, v)
    if isinstance(mask, BlockMask):
        # Contiguous copies: with fused q/k/v projections, v is a strided slice of one output
        # whose storage offset torch 2.13's compiled CPU flex kernel reads wrongly (wrong
        # results, seen in test_flex_prefill_matches_the_dense_mask); the copy is ~T*D elements.
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return sdpa_attend(q, k, v, mask)


def causal_attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal maskless attention (top-left aligned, equal lengths; k/v with fewer heads are read as
    grouped heads) and its log-sum-exp [B, H, T] fp32: cuDNN's kernel on CUDA (on the H200 31 us
    against the flash kernel's 54 at the DROID prompt, BENCHMARKS.md), the flash kernel on the CPU."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    else:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
    return out, lse.reshape(out.shape[:-1])


class SplitPattern:
    """The full prefill's pattern (query i sees key j when j <= i, or when both are image tokens)
    as two maskless causal attention calls merged by their log-sum-exps: every query over the keys
    at or before it (causal), and every image query over the image keys after it (gathered in
    reverse order, where "after" is "before": a causal call of one token's offset). The two key
    sets are disjoint and together are what the pattern shows, so the merge is exact up to
    rounding, and neither call reads a mask. On the H200 a decoder layer took 750 us with it
    against 828 with flex attention at the 8-image prompt, 389 against 390 at DROID's.

    The gathered rows have a fixed `capacity` (image tokens the bucket may hold: special tokens
    typed into an instruction add some), so refresh_ rewrites the index tensors in place and
    captured graphs stay valid. Unused rows come last in the reversed order, where only unused
    rows see them; their results go to token 0 (BOS, never an image token) with weight 0 for the
    second part, so token 0 gets its causal result back."""

    def __init__(self, image_token: torch.Tensor, capacity: Optional[int] = None):
        self.capacity = max(2, capacity if capacity is not None else int(image_token.sum()))
        dev = image_token.device
        self.order = torch.zeros(self.capacity, dtype=torch.long, device=dev)   # reversed image positions, then 0
        self.unused = torch.zeros(self.capacity - 1, dtype=torch.float32, device=dev)  # -inf: no second part
        self.refresh(image_token)

    def refresh(self, image_token: torch.Tensor) -> None:
        pos = torch.nonzero(image_token).flatten().flip(0)
        if pos.numel() > self.capacity:
            raise ValueError(f"{pos.numel()} image tokens, the bucket holds {self.capacity}")
        if pos.numel() and int(pos[-1]) == 0:
            raise ValueError("token 0 is an image token: the split pattern parks unused rows there")
        order = torch.zeros(self.capacity, dtype=torch.long, device=image_token.device)
        order[:pos.numel()] = pos
        self.order.copy_(order)
        unused = torch.zeros(self.capacity - 1, dtype=torch.float32, device=image_token.device)
        unused[max(pos.numel() - 1, 0):] = float("-inf")
        self.unused.copy_(unused)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, KV, T, D] (grouped heads) -> [B, H, T, D]."""
        out, lse = causal_attend_lse(q, k, v)
        rows, keys = self.order[1:], self.order[:-1]  # a query (reversed index r + 1) sees keys 0 .. r
        extra, lse_extra = causal_attend_lse(q[:, :, rows], k[:, :, keys], v[:, :, keys])
        lse_extra = lse_extra + self.unused
        base, lse_base = out[:, :, rows].float(), lse[:, :, rows]
        top = torch.maximum(lse_base, lse_extra)
        w_base, w_extra = torch.exp(lse_base - top), torch.exp(lse_extra - top)
        merged = (base * w_base[..., None] + extra.float() * w_extra[..., None]) / (w_base + w_extra)[..., None]
        return out.index_copy(2, rows, merged.to(out.dtype))


# The pattern kernel's query and key tiles (a key tile divides a query tile: the diagonal starts on
# one), warps and pipeline stages. Not yet tuned on a GPU (scripts/bench_prefill_attention.py times others).
PATTERN_TILES = (64, 64, 4, 2)


@triton.jit
def _pattern(Q, K, V, Img, Last, Out, T, heads, group, scale,
             sqb, sqh, sqm, skb, skh, skn, svb, svh, svn, sob, soh, som,
             D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Queries m0 .. m0 + BLOCK_M - 1 of one (batch, head): the keys before m0 without a mask, then
    from the diagonal to the block's end, or to the last image key where the block holds an image
    query, with the pattern's predicate (key <= query, or both image tokens) from the flags Img."""
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    b = bh // heads
    h = bh % heads
    rows = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < D
    r_ok = rows < T
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqm + offs_d[None, :], mask=r_ok[:, None] & d_ok[None, :],
                other=0.0)
    img_q = tl.load(Img + rows, mask=r_ok, other=0) != 0
    K += b * skb + h // group * skh
    V += b * svb + h // group * svh
    acc, m_i, l_i = softmax_start(BLOCK_M, BLOCK_D)
    acc, m_i, l_i = attend_keys(q, K, V, Img, skn, svn, 0, m0, T, scale, offs_d, d_ok, acc, m_i, l_i, BLOCK_N, False)
    hi = tl.where(tl.max(img_q.to(tl.int32), 0) > 0, tl.maximum(m0 + BLOCK_M, tl.load(Last)), m0 + BLOCK_M)
    for start in range(m0, hi, BLOCK_N):
        k, v, n_ok = load_keys(K, V, Img, skn, svn, start, hi, T, offs_d, d_ok, BLOCK_N, False)
        cols = start + tl.arange(0, BLOCK_N)
        img_k = tl.load(Img + cols, mask=n_ok, other=0) != 0
        ok = n_ok[None, :] & ((cols[None, :] <= rows[:, None]) | (img_q[:, None] & img_k[None, :]))
        acc, m_i, l_i = attend_chunk(q, k, v, ok, scale, acc, m_i, l_i)
    tl.store(Out + b * sob + h * soh + rows[:, None] * som + offs_d[None, :],
             (acc / l_i[:, None]).to(Out.dtype.element_ty), mask=r_ok[:, None] & d_ok[None, :])


@torch.library.custom_op("vla::pattern_attention", mutates_args=())
def pattern_attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, image: torch.Tensor,
                         last: torch.Tensor, block_m: int, block_n: int, warps: int, stages: int) -> torch.Tensor:
    b, heads, t, d = q.shape
    out = torch.empty((b, t, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)  # [B, H, T, D] view
    grid = (triton.cdiv(t, block_m), b * heads)
    _pattern[grid](q, k, v, image, last, out, t, heads, heads // k.shape[1], 1.0 / math.sqrt(d),
                   q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                   v.stride(0), v.stride(1), v.stride(2), out.stride(0), out.stride(1), out.stride(2),
                   D=d, BLOCK_D=triton.next_power_of_2(d), BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps,
                   num_stages=stages)
    return out


@pattern_attention_op.register_fake
def _(q, k, v, image, last, block_m, block_n, warps, stages):
    b, heads, t, d = q.shape
    return torch.empty((b, t, heads, d), dtype=q.dtype, device=q.device).transpose(1, 2)


class PatternKernel:
    """The full prefill's pattern in one flash-attention kernel (`_pattern`): no mask read, no
    gathers, no merge; each query block computes only the key blocks the pattern shows it. The
    image flags and the last image token's end live in device tensors that refresh rewrites in
    place, so captured graphs stay valid."""

    def __init__(self, image_token: torch.Tensor, tiles: tuple[int, int, int, int] = PATTERN_TILES):
        if tiles[0] % tiles[1]:
            raise ValueError(f"the pattern kernel's key tile must divide its query tile, got {tiles[:2]}")
        self.tiles = tiles
        self.image = torch.zeros(image_token.shape, dtype=torch.int8, device=image_token.device)
        self.last = torch.zeros(1, dtype=torch.int32, device=image_token.device)
        self.refresh(image_token)

    def refresh(self, image_token: torch.Tensor) -> None:
        self.image.copy_(image_token)
        ends = torch.arange(1, len(image_token) + 1, device=image_token.device) * image_token
        self.last.copy_(ends.max().reshape(1))

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, KV, T, D] (grouped heads) -> [B, H, T, D]."""
        return pattern_attention_op(q, k, v, self.image, self.last, *self.tiles)
