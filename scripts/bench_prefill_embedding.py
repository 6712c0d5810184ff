"""The prefill's input embeddings two ways, each in a CUDA graph of its own (molmobot-4b's widths,
random bf16 weights and image tokens in a frame store, the real prompt of each layout): as the
static runner runs them by default (FrameStore.read, then VLAPolicy.embed: the token embedding and
index_add) and in one compiled pass over the store (runtime/fusion.embed_from_store, the engine's
one_pass_embedding). Ten calls a graph, replays interleaved A-B-A-B (us a call, median of 20 replays
each), and whether the two outputs are bit for bit the same.

    PYTHONPATH=$PWD python3 scripts/bench_prefill_embedding.py [--layouts droid,8img] [--batch 1] [--json F]
"""
import argparse
import dataclasses
import json
import statistics
from types import SimpleNamespace

import torch

from vla_node.model import TINY_TOKENIZER, PromptBuilder, VLAPolicy, get_preset, load_tokenizer
from vla_node.runtime import LAYOUTS
from vla_node.runtime.frame_store import FrameStore
from vla_node.runtime.fusion import embed_from_store
from vla_node.runtime.graphs import capture, interleaved_ms
from vla_node.tools.bench import machine

CALLS = 10

def embeddings(layout_name: str, batch: int, device: str = "cuda"):
    """(default fn, one-pass fn, prompt length): each fn -> [batch, length, dim] for the layout's prompt."""
    layout = LAYOUTS[layout_name]
    cfg = get_preset("molmobot-4b")
    cfg = dataclasses.replace(cfg, prompt=dataclasses.replace(cfg.prompt, max_images=max(cfg.prompt.max_images,
                                                                                         layout.images)))
    prompt = PromptBuilder(load_tokenizer(TINY_TOKENIZER), cfg).build(len(layout.cameras), layout.frames,
                                                                      "put the marker in the bowl")
    dev, dt = torch.device(device), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    embed = torch.nn.Embedding(cfg.llm.embedding_rows, cfg.llm.dim, device=dev, dtype=dt)
    torch.nn.init.normal_(embed.weight, generator=g)
    store = FrameStore(2 * layout.images * batch, cfg.vision.tokens_per_image, cfg.llm.dim, dt, dev)
    store.tokens.normal_(generator=g)
    ids = torch.tensor(prompt.ids, device=dev).expand(batch, -1).contiguous()
    positions = torch.tensor(prompt.patch_positions, device=dev)
    slot_image = torch.full((len(prompt.ids),), -1, dtype=torch.long, device=dev)
    slot_image[positions] = torch.arange(len(positions), device=dev)
    rows = torch.randperm(store.capacity, generator=g, device=dev)[:layout.images * batch]
    model = SimpleNamespace(llm=SimpleNamespace(embed=embed))   # what VLAPolicy.embed reads
    one_pass = torch.compile(embed_from_store, fullgraph=True, dynamic=False)

    def default():
        image_tokens = store.read(rows).reshape(batch, -1, cfg.llm.dim)
        return VLAPolicy.embed(model, ids, image_tokens, positions)
    return default, lambda: one_pass(embed.weight, ids, store.tokens, rows, slot_image), len(prompt.ids)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default="droid,8img")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    with torch.inference_mode():
        for name in args.layouts.split(","):
            default, one_pass, length = embeddings(name, args.batch)
            # CALLS calls a graph: one call's few us would be lost beside a replay's launch
            graphs = {way: capture(lambda f=f: [f() for _ in range(CALLS)])
                      for way, f in (("default", default), ("one pass", one_pass))}
            ms = {way: [t / CALLS for t in times]
                  for way, times in interleaved_ms({way: graph for way, (graph, _) in graphs.items()}).items()}
            same = torch.equal(graphs["default"][1][-1], graphs["one pass"][1][-1])
            rows[name] = {"tokens": length, "bit_identical": same, **{w: statistics.median(v) for w, v in ms.items()}}
            print(f"{name}: {length} tokens, batch {args.batch}; bit for bit {same}; "
                  + ", ".join(f"{w} {v}" for w, v in ms.items()), flush=True)
    print(f"\n{'layout':>6} {'tokens':>6} {'default us':>11} {'one pass us':>12} {'bit for bit':>11}")
    for name, r in rows.items():
        print(f"{name:>6} {r['tokens']:>6} {r['default'] * 1e3:>11.1f} {r['one pass'] * 1e3:>12.1f} "
              f"{str(r['bit_identical']):>11}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "batch": args.batch, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
