"""Regenerate the small byte-level BPE tokenizer shipped for the tiny preset.

    python scripts/make_tiny_tokenizer.py vla_node/model/assets/tiny_tokenizer

Byte-level, so any instruction tokenizes (no unknown tokens); the corpus is robot-instruction
text plus the image labels of the prompt. Loaded through transformers from the local folder.
"""
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from vla_node.model.sequence import SPECIAL_TOKENS

VERBS = ["pick up", "put", "place", "move", "push", "pull", "open", "close", "grasp", "lift", "stack",
         "wipe", "pour", "turn", "press", "slide", "drop", "hand over", "fold", "insert"]
OBJECTS = ["the red cup", "the blue block", "the green bowl", "the marker", "the drawer", "the towel",
           "the lid", "the sponge", "the bottle", "the spoon", "the yellow cube", "the plate", "the door",
           "the can", "the mug", "the box", "the banana", "the apple", "the knife", "the pen"]
PLACES = ["on the table", "into the bowl", "in the sink", "on the shelf", "to the left", "to the right",
          "next to the plate", "inside the drawer", "onto the tray", "behind the box"]


def corpus():
    for v in VERBS:
        for o in OBJECTS:
            yield f"{v} {o}"
            for p in PLACES:
                yield f"{v} {o} {p}."
    for k in range(1, 10):
        for c in range(0, 10):
            yield f"Image {k} View {c}"
    yield "Robot action policy. Instruction: Task: what should the robot do next?"


def main(out: str) -> None:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus(), trainer)
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": SPECIAL_TOKENS[0],
        "eos_token": SPECIAL_TOKENS[0],
        "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
        "model_max_length": 1024,
    }, indent=2) + "\n")
    print(f"wrote {path} (vocab {tok.get_vocab_size()})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "vla_node/model/assets/tiny_tokenizer")
