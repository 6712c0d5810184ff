"""The LLM prefill's attention pattern (causal, plus image tokens seeing each other both ways)
through flex attention with a block mask, instead of SDPA with a dense [T, S] boolean mask (which
CUDA runs with the memory-efficient kernel, reading the mask for every block, and the CPU with
the math kernel). Blocks that the pattern leaves fully visible or fully hidden skip the mask
entirely; compiled (the `compile` rung), flex attention becomes one Triton kernel per call.
The full prefill (every token of the bucket, from the first) can instead run the pattern as two
maskless causal calls (SplitPattern, `split_attention`), and it and the streaming step as one Triton
kernel that computes the pattern from the image flags (kernels/pattern_attention.PatternAttention,
`pattern_kernel`); otherwise the streaming step keeps flex.

`block_mask` builds the mask once per bucket (lengths fixed); `refresh_` rebuilds it in place, so
CUDA graphs that captured it keep reading the right tensors.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ...model.llm import sdpa_attend
from .pattern_attention import PatternAttention
from .split_gather import split_gather_op
from .split_merge import merge_by_lse, merge_split_op

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
                mask: Optional[Union[BlockMask, "SplitPattern", PatternAttention, torch.Tensor]]) -> torch.Tensor:
    """Drop-in for llm.sdpa_attend that runs flex attention when given a BlockMask (the split
    pattern's two calls when given a SplitPattern, the pattern kernel when given a PatternAttention:
    it reads the strided views as they are)."""
    if isinstance(mask, PatternAttention):
        return mask.attend(q, k, v)
    # Contiguous copies (~T*D elements each) of the strided views a layer makes (rotary q/k
    # transposed, v a slice of the fused projection's output), for the kernels that misread them:
    # torch 2.13's compiled CPU flex kernel (wrong results, seen in test_flex_prefill_matches_the_dense_mask),
    # and the split's fp32 calls compiled on the H200 (an fp32 `compile` engine 4.5e-2 relative L2
    # off eager; with the copies 1.2e-7, scripts/bisect_regions.py). The split's half-precision
    # calls take cuDNN's kernel, which reads them right.
    split = isinstance(mask, SplitPattern)
    if isinstance(mask, BlockMask) or (split and q.is_cuda and q.dtype == torch.float32):
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if split:
        return mask.attend(q, k, v)
    if isinstance(mask, BlockMask):
        return flex_attention(q, k, v, block_mask=mask, enable_gqa=True)
    return sdpa_attend(q, k, v, mask)


def causal_attend_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal maskless attention (top-left aligned, equal lengths; k/v with fewer heads are read as
    grouped heads) and its log-sum-exp [B, H, T] fp32: cuDNN's kernel on CUDA in half precision
    (on the H200 31 us against the flash kernel's 54 at the DROID prompt, BENCHMARKS.md), the
    memory-efficient kernel on CUDA in fp32 (cuDNN's takes half precision only: given fp32 it
    returned NaN without an error), the flash kernel on the CPU."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
    elif q.dtype in (torch.float16, torch.bfloat16):
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False)[:2]
    else:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, True)[:2]
    # cuDNN's is [B, H, T, 1], the memory-efficient kernel's [B, H, T rounded up to 32]
    return out, lse.reshape(*out.shape[:2], -1)[..., :out.shape[2]]


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

    def __init__(self, image_token: torch.Tensor, capacity: Optional[int] = None, merge_kernel: bool = False,
                 gather_kernel: bool = False, one_call: bool = False):
        self.capacity = max(2, capacity if capacity is not None else int(image_token.sum()))
        if self.capacity > image_token.numel():
            raise ValueError(f"capacity {self.capacity} exceeds the {image_token.numel()} tokens")
        self.merge_kernel = merge_kernel   # the merge as kernels/split_merge's one pass, not torch ops
        self.gather_kernel = gather_kernel   # the second call's gathers as kernels/split_gather's one pass
        # The two causal calls as one of batch 2B, the image rows padded at their end to T (a causal
        # row never sees the padding after it): one launch with twice the programs, where the first
        # call alone fills a wave and a half of the H200's SMs at DROID. Its gathers are indexing,
        # which a compiled region fuses into the copy that builds the batch.
        self.one_call = one_call
        dev = image_token.device
        self.order = torch.zeros(self.capacity, dtype=torch.long, device=dev)   # reversed image positions, then 0
        self.unused = torch.zeros(self.capacity - 1, dtype=torch.float32, device=dev)  # -inf: no second part
        self.extra_row = torch.zeros(image_token.numel(), dtype=torch.long, device=dev)  # a token's row in rows, -1
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
        extra_row = torch.full_like(self.extra_row, -1)
        extra_row[pos[1:]] = torch.arange(max(pos.numel() - 1, 0), device=image_token.device)
        self.extra_row.copy_(extra_row)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, D], k/v [B, KV, T, D] (grouped heads) -> [B, H, T, D]."""
        rows, keys = self.order[1:], self.order[:-1]  # a query (reversed index r + 1) sees keys 0 .. r
        if self.one_call:
            b, n, pad = q.shape[0], rows.numel(), q.shape[2] - rows.numel()
            both = [torch.cat([x, F.pad(x[:, :, index], (0, 0, 0, pad))])
                    for x, index in ((q, rows), (k, keys), (v, keys))]
            out, lse = causal_attend_lse(*both)
            out, lse, extra, lse_extra = out[:b], lse[:b], out[b:, :, :n], lse[b:, :, :n]
        else:
            out, lse = causal_attend_lse(q, k, v)
            gathered = split_gather_op(q, k, v, rows, keys) if self.gather_kernel else \
                (q[:, :, rows], k[:, :, keys], v[:, :, keys])
            extra, lse_extra = causal_attend_lse(*gathered)
        if self.merge_kernel:
            return merge_split_op(out, lse, extra, lse_extra, self.extra_row, self.unused)
        merged = merge_by_lse(out[:, :, rows], lse[:, :, rows], extra, lse_extra + self.unused)
        return out.index_copy(2, rows, merged.to(out.dtype))
