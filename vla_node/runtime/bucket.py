"""Device buffers of one window layout (a bucket) at one batch size and instruction token budget:
the padded prompts, their attention mask, RoPE tables, the query's inputs and the stages'
outputs. Shapes never change after construction, so stages that read and write only these can be
compiled once and captured as CUDA graphs.

A batch's entries share the layout, so they share the padded length, the image part of the
prompt, the prefill's attention mask and the RoPE tables; each row has its own instruction
tokens, cross-attention mask (its instruction's length), state, noise and known actions."""
from __future__ import annotations

import torch

from ..model.action_expert import KnownActions
from ..model.layers import rope_tables
from .parts import EngineParts
from .types import WindowLayout


class Bucket:
    """Device buffers of one window layout at one instruction token budget (the chat turn is
    padded to it), for `batch` entries."""

    def __init__(self, engine: EngineParts, layout: WindowLayout, batch: int, budget: int, cache_len: int):
        m, dev = engine.model, engine.device
        self.layout, self.batch = layout, batch
        prompt = engine.prompts.build(len(layout.cameras), layout.frames, "x")
        self.instruction_start = prompt.instruction_start
        self.length = prompt.instruction_start + budget
        ids = torch.full((batch, self.length), engine.prompts.pad_id, dtype=torch.long)
        ids[:, :self.instruction_start] = torch.tensor(prompt.ids[:self.instruction_start])
        self.ids = ids.to(dev)
        # Tokens that see each other both ways (none without bidirectional image attention).
        self.image_token = torch.zeros(self.length, dtype=torch.bool)
        if m.cfg.prompt.bidirectional_images:
            self.image_token[:self.instruction_start] = torch.tensor(prompt.image_token[:self.instruction_start])
        self.mask = self._mask().to(dev)  # [length, length]
        self.attn_mask = self.mask  # the prefill's attention's: this, a BlockMask or a PatternAttention
        self.image_token_dev = None
        if engine.config.flex_attention:
            from .kernels.prefill_attention import pattern_for

            # On the device and padded to the cache length: the streaming step's keys reach past the bucket.
            self.image_token_dev = torch.zeros(cache_len, dtype=torch.bool, device=dev)
            self.image_token_dev[:self.length] = self.image_token
            self.attn_mask = pattern_for(self.image_token_dev, 0, self.length, self.length,
                                         engine.config.pattern_kernel)
        self.patch_positions = torch.tensor(prompt.patch_positions, device=dev)
        # Each slot's index among an entry's image tokens, or -1 (fusion.embed_from_store reads it).
        self.slot_image = torch.full((self.length,), -1, dtype=torch.long, device=dev)
        self.slot_image[self.patch_positions] = torch.arange(len(self.patch_positions), device=dev)
        self.slots = torch.arange(self.length, device=dev)
        llm = m.cfg.llm
        self.cos, self.sin = rope_tables(llm.head_dim, self.slots, llm.rope_theta)
        if engine.config.q_rope_in_attention:   # the pattern kernel norms and rotates q itself
            self.attn_mask.rope_tables = (self.cos, self.sin)
        self.ctx_mask = torch.ones((batch, 1, 1, self.length + 1), dtype=torch.bool, device=dev)  # + the state token
        self.frame_rows = torch.zeros(batch * layout.images, dtype=torch.long, device=dev)   # entry-major
        a = m.cfg.action
        self.state = torch.zeros((batch, a.state_dim), dtype=torch.float32, device=dev)
        self.noise = torch.zeros((batch, a.horizon, a.action_dim), dtype=torch.float32, device=dev)
        self.x = torch.zeros_like(self.noise)          # adaptive action caching: the flow state,
        self.v_last = torch.zeros_like(self.noise)     # the last computed velocity,
        self.change = torch.zeros((), device=dev)      # and its relative change from the one before
        # The query's known prefix (normalised, padded to the horizon, and its mask): what the
        # inpainting flow loop reads, so every prefix length replays one graph.
        self.known = KnownActions(torch.zeros_like(self.noise),
                                  torch.zeros((batch, a.horizon, 1), dtype=torch.bool, device=dev))
        self.instructions: list[str | None] = [None] * batch   # each row's
        self.graphs: dict[str, torch.cuda.CUDAGraph] = {}
        self.graph_outputs: dict[str, torch.Tensor] = {}   # the output tensor of a graph that returns one
        self.prompt = prompt  # its image part (the instruction of a query is set by set_instruction)
        self.stream = None  # streaming.StreamBuffers, set by the runner under streaming_kv
        # Stage outputs; under CUDA graphs these are the graphs' own output tensors.
        self.hidden: list[torch.Tensor] = []
        self.state_norm: torch.Tensor | None = None
        self.kv: list | None = None
        self.out: torch.Tensor | None = None

    def _mask(self) -> torch.Tensor:
        """Causal, plus image special tokens seeing each other (the padding at the end is seen by
        no real token: it comes after all of them and is no image token)."""
        mask = torch.ones(self.length, self.length, dtype=torch.bool).tril()
        return mask | (self.image_token[:, None] & self.image_token[None, :])

    def set_instruction(self, engine: EngineParts, text: str, entry: int = 0) -> None:
        """Row `entry`'s instruction. One that types an image special token changes the prefill's
        mask, which the rows share: such a query runs alone (PolicyEngine.batch_key)."""
        if text == self.instructions[entry]:
            return
        tokens = engine.prompts.instruction(text)
        n, start = len(tokens), self.instruction_start
        row = torch.full((self.length - start,), engine.prompts.pad_id, dtype=torch.long)
        row[:n] = torch.tensor(tokens)
        image = torch.tensor([t in engine.prompts.bidirectional_ids for t in row.tolist()])
        image &= engine.model.cfg.prompt.bidirectional_images
        if bool(image.any() or self.image_token[start:].any()):  # special tokens typed into the instruction
            if self.batch > 1:
                raise ValueError("an instruction with image special tokens has a prefill mask of its own: run it "
                                 "alone (batch of 1)")
            self.image_token[start:] = image
            self._masks_changed()
        # Not waiting for the device (a pageable source is staged before the call returns): a new
        # instruction is queued while the vision stage runs.
        self.ids[entry, start:].copy_(row, non_blocking=True)
        mask = torch.ones(self.length + 1, dtype=torch.bool)
        mask[start + n:self.length] = False
        self.ctx_mask[entry].view(-1).copy_(mask, non_blocking=True)
        self.instructions[entry] = text

    def _masks_changed(self) -> None:
        """Rewrite every attention mask in place (captured graphs keep reading the same tensors)."""
        self.mask.copy_(self._mask())
        if self.image_token_dev is not None:
            from .kernels.prefill_attention import refresh_

            self.image_token_dev[:self.length].copy_(self.image_token)
            refresh_(self.attn_mask, self.image_token_dev, 0)
        if self.stream is not None:
            self.stream.refresh_mask(self)
