"""The prompt, laid out as the official MolmoBot preprocessor lays it out:

    BOS, then per image: [label] <im_start> <im_patch> x tokens_per_image <im_end>,
    then the chat turn with the instruction (PromptConfig.chat_template), no state.

Images are in slot order: all cameras of the oldest frame time first, the newest frame time last.
Labels: none for a single image; "Image k" (k = 1, 2, ...) when the checkpoint sees single frames;
otherwise "Image <f> View <c>" with c = camera + 1 and f counted so that the newest frame time is
always max_images / cameras - 1: a window with fewer frames (an episode's start) keeps the labels
its frames had in a full window. Image features are added to the embeddings of <im_patch>.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .config import ModelConfig
from .tokenizer import BIDIRECTIONAL_TOKENS, IM_END, IM_PATCH, IM_START, bos_id


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]                 # token ids of the whole prompt
    image_token: tuple[bool, ...]        # tokens that attend to each other both ways (bidirectional mode)
    patch_positions: tuple[int, ...]     # index of every <im_patch>, in slot order
    block_starts: tuple[int, ...]        # first token (the label) of each image block
    instruction_start: int               # first token of the chat turn
    images: int

    def __len__(self) -> int:
        return len(self.ids)


class PromptBuilder:
    def __init__(self, tokenizer, cfg: ModelConfig):
        self.tokenizer = tokenizer
        self.cfg = cfg.prompt
        self.tokens_per_image = cfg.vision.tokens_per_image
        vocab = tokenizer.get_vocab()
        self.bos = bos_id(tokenizer)
        self.im_start, self.im_end, self.im_patch = (vocab[t] for t in (IM_START, IM_END, IM_PATCH))
        self.bidirectional_ids = frozenset(vocab[t] for t in BIDIRECTIONAL_TOKENS if t in vocab)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.bos

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def labels(self, cameras: int, frames: int) -> list[str]:
        """The label of each slot of a window with `frames` frame times of `cameras` cameras."""
        n = cameras * frames
        if n == 1:
            return [""]
        if self.cfg.single_frame:
            if frames > 1:
                raise ValueError("this checkpoint sees single frames (single_frame); a window with history is not "
                                 "supported")
            return [f"Image {i + 1}" for i in range(n)]
        first = self.cfg.max_images // cameras - frames
        if n > self.cfg.max_images or self.cfg.max_images % cameras or first < 0:
            raise ValueError(f"a window of {frames} frames x {cameras} cameras does not fit the checkpoint's "
                             f"max_images={self.cfg.max_images}")
        return [f"Image {first + f} View {c + 1}" for f in range(frames) for c in range(cameras)]

    @functools.lru_cache(maxsize=64)
    def image_blocks(self, cameras: int, frames: int) -> tuple[tuple[int, ...], ...]:
        """Token ids of each slot's image block."""
        return tuple(tuple(self._encode(label)) + (self.im_start,) + (self.im_patch,) * self.tokens_per_image
                     + (self.im_end,) for label in self.labels(cameras, frames))

    @functools.lru_cache(maxsize=256)
    def instruction(self, text: str) -> tuple[int, ...]:
        """The chat turn holding the instruction (encoded as one string, as the official code does)."""
        if not text.strip():
            raise ValueError("instruction is empty")
        return tuple(self._encode(self.cfg.chat_template.replace("{instruction}", text)))

    def build(self, cameras: int, frames: int, instruction: str) -> Prompt:
        ids, starts, patches = [self.bos], [], []
        for block in self.image_blocks(cameras, frames):
            starts.append(len(ids))
            patches.extend(len(ids) + i for i, t in enumerate(block) if t == self.im_patch)
            ids.extend(block)
        instruction_start = len(ids)
        ids.extend(self.instruction(instruction))
        return Prompt(ids=tuple(ids), image_token=tuple(t in self.bidirectional_ids for t in ids),
                      patch_positions=tuple(patches), block_starts=tuple(starts),
                      instruction_start=instruction_start, images=cameras * frames)
