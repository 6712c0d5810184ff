"""Tokenizers from local folders (never downloaded), with the official MolmoBot special tokens.

The official code loads the LLM's tokenizer and adds its image special tokens right after the
embedding table's rows (padding the vocabulary with placeholder tokens up to that size), so
`<im_start>` is token `vocab_size`, `<im_end>` `vocab_size + 1`, ... A checkpoint folder holds the
tokenizer in that extended form; `extend_tokenizer` makes it from the base tokenizer.
"""
from __future__ import annotations

from pathlib import Path

# The official order: ids vocab_size + 0, 1, 2, ...
IMAGE_SPECIAL_TOKENS = ("<im_start>", "<im_end>", "<im_patch>", "<im_col>", "<low_res_im_start>", "<|image|>",
                        "<im_low>", "<frame_start>", "<frame_end>", "<|video|>")
IM_START, IM_END, IM_PATCH = IMAGE_SPECIAL_TOKENS[:3]
# Tokens that attend to each other in both directions under `bi_directional_attn: image_tokens`.
BIDIRECTIONAL_TOKENS = ("<im_patch>", "<im_col>", "<im_start>", "<low_res_im_start>", "<frame_start>", "<im_end>",
                        "<frame_end>", "<im_low>")


def _auto_tokenizer(source: str | Path, **kwargs):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source), local_files_only=True, **kwargs)


def load_tokenizer(folder: str | Path):
    """A transformers tokenizer from a local folder that holds the image special tokens."""
    folder = Path(folder)
    if not (folder / "tokenizer.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        raise FileNotFoundError(f"no tokenizer in {folder} (expected tokenizer.json / tokenizer_config.json)")
    tok = _auto_tokenizer(folder)
    vocab = tok.get_vocab()
    missing = [t for t in IMAGE_SPECIAL_TOKENS if t not in vocab]
    if missing:
        raise ValueError(f"tokenizer in {folder} lacks the image special tokens {missing} "
                         f"(make it with vla-convert, which adds them as the official code does)")
    return tok


def bos_id(tok) -> int:
    """The official BOS: the tokenizer's BOS, or its EOS where it has none (Qwen)."""
    return tok.bos_token_id or tok.eos_token_id


def extend_tokenizer(base: str | Path, out_dir: str | Path, vocab_size: int) -> Path:
    """Write the base tokenizer (a local folder, or a hub id already in the local Hugging Face
    cache) with the image special tokens at ids vocab_size, vocab_size + 1, ... (placeholder
    tokens fill the gap between the tokenizer's size and the embedding table)."""
    size = len(_auto_tokenizer(base))
    if size > vocab_size:
        raise ValueError(f"tokenizer {base} has {size} tokens, more than the embedding's {vocab_size} rows")
    placeholders = [f"|<EXTRA_TOKENS_{i}>|" for i in range(vocab_size - size)]
    tok = _auto_tokenizer(base, additional_special_tokens=placeholders + list(IMAGE_SPECIAL_TOKENS))
    for i, token in enumerate(IMAGE_SPECIAL_TOKENS):
        ids = tok.encode(token, add_special_tokens=False)
        if ids != [vocab_size + i]:
            raise ValueError(f"tokenizer {base}: {token} got ids {ids}, the official layout needs [{vocab_size + i}]")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out_dir))
    return out_dir
