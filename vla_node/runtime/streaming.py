"""Streaming LLM KV across overlapping windows (opt-in `streaming_kv`).

A robot re-queries on windows that share most frames: with frames t-8 and t per camera,
re-queried every 8 frames, the newest frame time of one window is the oldest of the next.
Slot j of the new window is slot j + C of the old one (C cameras). The streaming step:

1. shifts the surviving frames' keys/values from slot j + C to slot j. Keys are cached after
   RoPE, so they are rotated by -shift positions: every key then carries exactly the position a
   full recompute would give it (RoPE rotations compose);
2. shifts the action expert's per-token context K/V the same way (it has no positions);
3. prefills only the new frames' blocks and the instruction, attending to the cached prefix
   and surviving frames (new image tokens see every image token, as in the full prompt), and
   recomputes the state token's K/V.

The BOS before the images is never recomputed. What is not exact: the surviving frames'
keys/values were computed while the evicted frames were visible and, with the official
bidirectional image attention, without seeing the new frames that a full recompute lets them
attend to; their label tokens keep the old "Image k" text. The benchmark measures the action
deviation this causes against a full recompute.
"""
from __future__ import annotations

from typing import Hashable, Optional, Sequence

import torch

from ..model.layers import apply_rope, rope_tables
from .bucket import Bucket
from .parts import EngineParts


class StreamBuffers:
    """Static index tables and the persistent expert context of one bucket."""

    def __init__(self, engine: EngineParts, bucket: Bucket):
        m, dev, prompt = engine.model, engine.device, bucket.prompt
        layout = bucket.layout
        cams, n = len(layout.cameras), layout.images
        self.cameras = cams
        llm = m.cfg.llm
        starts = list(prompt.block_starts) + [prompt.instruction_start]
        lengths = {b - a for a, b in zip(starts, starts[1:])}
        if len(lengths) != 1:
            raise ValueError(f"streaming_kv needs image blocks of one length; the labels give {sorted(lengths)}")
        shift = starts[cams] - starts[0]
        self.new_start = starts[n - cams]
        self.shift_src = torch.arange(starts[cams], self.new_start + shift, device=dev)
        self.shift_dst = self.shift_src - shift
        self.rot_cos, self.rot_sin = rope_tables(llm.head_dim, torch.tensor([-shift], device=dev), llm.rope_theta)
        self.new_slots = bucket.slots[self.new_start:]
        self.new_cos, self.new_sin = bucket.cos[self.new_start:], bucket.sin[self.new_start:]
        # New tokens see what they see in the full prompt: the bucket's mask rows, over the cache.
        self.cache_len = m.llm.layers[0].attn.cache.k.shape[2]
        self.mask = torch.zeros((len(self.new_slots), self.cache_len), dtype=torch.bool, device=dev)
        self.attn_mask = self.mask
        if bucket.image_token_dev is not None:   # the new rows over the cache
            from .kernels.prefill_attention import pattern_for

            self.attn_mask = pattern_for(bucket.image_token_dev, self.new_start, len(self.new_slots), self.cache_len,
                                         engine.config.pattern_kernel)
        self.refresh_mask(bucket)
        self.new_patch_positions = bucket.patch_positions[(n - cams) * m.cfg.vision.tokens_per_image:] - self.new_start
        heads, hd = m.cfg.action.heads, m.cfg.action.width // m.cfg.action.heads
        shape = (1, heads, bucket.length + 1, hd)
        self.kv = [(torch.zeros(shape, dtype=engine.dtype, device=dev),
                    torch.zeros(shape, dtype=engine.dtype, device=dev)) for _ in m.expert.blocks]
        self.last_ids: Optional[list[Hashable]] = None

    def refresh_mask(self, bucket: Bucket) -> None:
        self.mask[:, :bucket.length].copy_(bucket.mask[self.new_start:])
        if self.attn_mask is not self.mask:
            from .kernels.prefill_attention import refresh_

            refresh_(self.attn_mask, bucket.image_token_dev, self.new_start)

    def slides_from(self, frame_ids: Sequence[Optional[Hashable]]) -> bool:
        """Is this window the last one moved on by one frame time (surviving frames known)?"""
        if self.last_ids is None or any(f is None for f in frame_ids):
            return False
        return list(frame_ids[:-self.cameras]) == self.last_ids[self.cameras:]

    def store_full(self, kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for (k_dst, v_dst), (k, v) in zip(self.kv, kv):
            k_dst.copy_(k)
            v_dst.copy_(v)

    def step(self, engine: EngineParts, bucket: Bucket, frame_tokens: torch.Tensor) -> None:
        """The streaming prefill (a captured stage): static buffers in, caches updated in place."""
        m = engine.model
        for layer in m.llm.layers:
            cache = layer.attn.cache
            keys = apply_rope(cache.k.index_select(2, self.shift_src), self.rot_cos, self.rot_sin)
            cache.k.index_copy_(2, self.shift_dst, keys)
            cache.v.index_copy_(2, self.shift_dst, cache.v.index_select(2, self.shift_src))
        for k, v in self.kv:
            k.index_copy_(2, self.shift_dst, k.index_select(2, self.shift_src))
            v.index_copy_(2, self.shift_dst, v.index_select(2, self.shift_src))
        embeds = m.embed(bucket.ids[:, self.new_start:], frame_tokens, self.new_patch_positions)
        hidden = m.llm(embeds, self.new_cos, self.new_sin, self.attn_mask, self.new_slots, attend_cache=True)
        state_token = m.expert.state_token(m.normalize_state(bucket.state).to(engine.dtype))
        for block, h, (k, v) in zip(m.expert.blocks, hidden, self.kv):
            new_k, new_v = block.token_kv(m.expert.context_tokens(h))
            k.index_copy_(2, self.new_slots, new_k)
            v.index_copy_(2, self.new_slots, new_v)
            state_k, state_v = block.token_kv(state_token)
            k[:, :, -1:].copy_(state_k)
            v[:, :, -1:].copy_(state_v)
