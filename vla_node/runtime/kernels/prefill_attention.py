"""The LLM prefill's attention pattern (causal, plus image tokens seeing each other both ways)
through flex attention with a block mask, instead of SDPA with a dense [T, S] boolean mask (which
CUDA runs with the memory-efficient kernel, reading the mask for every block, and the CPU with
the math kernel). Blocks that the pattern leaves fully visible or fully hidden skip the mask
entirely; compiled (the `compile` rung), flex attention becomes one Triton kernel per call.
The full prefill and the streaming step can instead run the pattern as one Triton kernel that
computes it from the image flags (kernels/pattern_attention.PatternAttention, `pattern_kernel`).

`pattern_for` builds the block mask (or the pattern kernel's tables) once per bucket (lengths
fixed); `refresh_` rebuilds either in place, so CUDA graphs that captured it keep reading the right
tensors.
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from ...model.llm import sdpa_attend
from .pattern_attention import PatternAttention

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


def pattern_for(image_token: torch.Tensor, q_offset: int, q_len: int, kv_len: int,
                kernel: bool) -> Union[BlockMask, PatternAttention]:
    """What flex_attend takes for block_mask's pattern: the pattern kernel's tables (`kernel`,
    EngineConfig.pattern_kernel) or flex attention's block mask."""
    if kernel:
        return PatternAttention(image_token[:kv_len], q_offset, q_len)
    return block_mask(image_token, q_offset, q_len, kv_len)


def refresh_(mask: Union[BlockMask, PatternAttention], image_token: torch.Tensor, q_offset: int) -> None:
    """Rebuild a pattern_for result in place after `image_token` changed (same lengths, same tensors)."""
    if isinstance(mask, PatternAttention):
        mask.refresh(image_token[:mask.image.numel()])
        return
    new = block_mask(image_token, q_offset, mask.seq_lengths[0], mask.seq_lengths[1])
    for field in _INDEX_FIELDS:
        old, fresh = getattr(mask, field), getattr(new, field)
        if old is not None:
            old.copy_(fresh)


def flex_attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: Optional[Union[BlockMask, PatternAttention, torch.Tensor]]) -> torch.Tensor:
    """Drop-in for llm.sdpa_attend that runs flex attention when given a BlockMask and the pattern
    kernel when given a PatternAttention (it reads the strided views as they are)."""
    if isinstance(mask, PatternAttention):
        return mask.attend(q, k, v)
    if isinstance(mask, BlockMask):
        # Contiguous copies (~T*D elements each) of the strided views a layer makes (rotary q/k
        # transposed, v a slice of the fused projection's output): torch 2.13's compiled CPU flex
        # kernel misreads them (wrong results, seen in test_flex_prefill_matches_the_dense_mask).
        return flex_attention(q.contiguous(), k.contiguous(), v.contiguous(), block_mask=mask, enable_gqa=True)
    return sdpa_attend(q, k, v, mask)
