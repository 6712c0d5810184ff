"""Regenerate the small byte-level BPE tokenizer shipped for the tiny preset.

    python scripts/make_tiny_tokenizer.py vla_node/model/assets/tiny_tokenizer

Byte-level, so any instruction tokenizes (no unknown tokens); the corpus is robot-instruction
text, the image labels and the chat markers of the prompt. Like Qwen's, it has <|endoftext|>,
<|im_start|> and <|im_end|> (EOS, which also serves as BOS); then the image special tokens are
added after its 320 rows exactly as for a converted official checkpoint (model/tokenizer.py).
Loaded through transformers from the local folder.
"""
import json
import sys
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vla_node.model.config import get_preset
from vla_node.model.tokenizer import extend_tokenizer

CHAT_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VERBS = ["pick up", "put", "place", "move", "push", "pull", "open", "close", "grasp", "lift", "stack",
         "wipe", "pour", "turn", "press", "slide", "drop", "hand over", "fold", "insert", "transfer"]
OBJECTS = ["the red cup", "the blue block", "the green bowl", "the marker", "the drawer", "the towel",
           "the lid", "the sponge", "the bottle", "the spoon", "the yellow cube", "the plate", "the door",
           "the can", "the mug", "the box", "the banana", "the apple", "the knife", "the pen", "the cube"]
PLACES = ["on the table", "into the bowl", "in the sink", "on the shelf", "to the left", "to the right",
          "next to the plate", "inside the drawer", "onto the tray", "behind the box", "to the other arm"]


def corpus():
    for v in VERBS:
        for o in OBJECTS:
            yield f"user\ndemo: {v} {o}\nassistant\n"
            for p in PLACES:
                yield f"{v} {o} {p}."
    for k in range(0, 10):
        for c in range(1, 4):
            yield f"Image {k} View {c}"


def main(out: str) -> None:
    vocab_size = get_preset("tiny").llm.vocab_size
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(CHAT_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    with tempfile.TemporaryDirectory() as base:
        tok.save(str(Path(base) / "tokenizer.json"))
        (Path(base) / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "PreTrainedTokenizerFast", "pad_token": CHAT_TOKENS[0], "eos_token": CHAT_TOKENS[2],
            "model_max_length": 1024}, indent=2) + "\n")
        path = extend_tokenizer(base, out, vocab_size)
    print(f"wrote {path} (base vocabulary {tok.get_vocab_size()}, padded to {vocab_size} + image tokens)")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vla_node/model/assets/tiny_tokenizer")
