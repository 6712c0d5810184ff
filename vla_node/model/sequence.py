"""The prompt: a text prefix, one block per image, then the instruction.

    [prefix] ([label "Image k View v"] <im_start> <im_patch> x tokens_per_image <im_end>) x images [instruction]

Images are in slot order: oldest history frame first, cameras in configured order within a
frame time. Image features are added to the embeddings of the <im_patch> placeholders. Every
image block has the same length, so slot j always starts at the same position for a layout.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<im_start>", "<im_end>", "<im_patch>")
PAD, IM_START, IM_END, IM_PATCH = SPECIAL_TOKENS
PROMPT_PREFIX = "Robot action policy."
INSTRUCTION_PREFIX = " Instruction: "


def load_tokenizer(folder: str | Path):
    """A transformers tokenizer from a local folder (never downloads)."""
    from transformers import AutoTokenizer

    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {folder} (expected tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    vocab = tok.get_vocab()
    missing = [t for t in SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer in {folder} lacks the special tokens {missing}")
    return tok


@dataclass(frozen=True)
class Prompt:
    ids: tuple[int, ...]             # token ids of the whole prompt
    prefix_len: int                  # tokens before the first image block
    block_len: int                   # tokens of one image block
    patch_offset: int                # first <im_patch> within a block
    images: int
    instruction_start: int

    def patch_start(self, slot: int) -> int:
        return self.prefix_len + slot * self.block_len + self.patch_offset

    def __len__(self) -> int:
        return len(self.ids)


class PromptBuilder:
    def __init__(self, tokenizer, tokens_per_image: int):
        self.tokenizer = tokenizer
        self.tokens_per_image = tokens_per_image
        vocab = tokenizer.get_vocab()
        self.pad_id, self.im_start, self.im_end, self.im_patch = (vocab[t] for t in SPECIAL_TOKENS)
        self.prefix = tuple(self._encode(PROMPT_PREFIX))

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    @functools.lru_cache(maxsize=64)
    def image_blocks(self, cameras: int, frames: int) -> tuple[tuple[int, ...], int, int]:
        """All image blocks of a layout, the length of one block and the offset of its patches."""
        blocks, lengths = [], set()
        for slot in range(cameras * frames):
            label = self._encode(f" Image {slot + 1} View {slot % cameras}")
            block = label + [self.im_start] + [self.im_patch] * self.tokens_per_image + [self.im_end]
            lengths.add((len(block), len(label) + 1))
            blocks.extend(block)
        if len(lengths) != 1:
            raise ValueError(f"image labels tokenize to different lengths {sorted(lengths)}; slots need a fixed length")
        (block_len, patch_offset), = lengths
        return tuple(blocks), block_len, patch_offset

    @functools.lru_cache(maxsize=256)
    def instruction(self, text: str) -> tuple[int, ...]:
        if not text.strip():
            raise ValueError("instruction is empty")
        return tuple(self._encode(INSTRUCTION_PREFIX + text.strip()))

    def build(self, cameras: int, frames: int, instruction: str) -> Prompt:
        blocks, block_len, patch_offset = self.image_blocks(cameras, frames)
        instr = self.instruction(instruction)
        ids = self.prefix + blocks + instr
        return Prompt(ids=ids, prefix_len=len(self.prefix), block_len=block_len, patch_offset=patch_offset,
                      images=cameras * frames, instruction_start=len(self.prefix) + len(blocks))
