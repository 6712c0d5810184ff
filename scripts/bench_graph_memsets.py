"""What a captured graph's memset nodes cost, and what kernel nodes in their place buy
(runtime/graph_memsets.py): molmobot-4b's ViT attention as the engine runs it (fused q/k/v GEMM,
cuDNN SDPA at head_dim 72, out projection) for 25 layers at DROID's 4 images and the 8-image
window, random bf16 weights and inputs, one CUDA graph each way: the graph's memset nodes, its
replay (ms, median of 20), and whether the two ways' outputs are bit for bit the same.

    PYTHONPATH=$PWD python3 scripts/bench_graph_memsets.py [--images 4,8] [--json F]
"""
import argparse
import json
import statistics

import torch
import torch.nn.functional as F

from vla_node.model import get_preset
from vla_node.runtime.graphs import capture, interleaved_ms
from vla_node.tools.bench import machine


def vit_attention_layers(images: int, layers: int = 25):
    """fn() -> output: `layers` of qkv -> SDPA -> out projection on [images * 729, 1152]."""
    cfg = get_preset("molmobot-4b").vision
    t, w, heads = cfg.grid * cfg.grid, cfg.width, cfg.heads
    dev, dt = torch.device("cuda"), torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(images, t, w, device=dev, dtype=dt, generator=g)
    weights = [(torch.randn(3 * w, w, device=dev, dtype=dt, generator=g) * w ** -0.5,
                torch.randn(3 * w, device=dev, dtype=dt, generator=g) * 0.02,
                torch.randn(w, w, device=dev, dtype=dt, generator=g) * w ** -0.5,
                torch.randn(w, device=dev, dtype=dt, generator=g) * 0.02) for _ in range(layers)]

    def fn():
        h = x
        for wqkv, bqkv, wo, bo in weights:
            q, k, v = (y.view(images, t, heads, -1).transpose(1, 2) for y in F.linear(h, wqkv, bqkv).chunk(3, -1))
            h = h + F.linear(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(images, t, w), wo, bo)
        return h
    return fn


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--images", default="4,8")
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = {}
    with torch.inference_mode():
        for images in (int(n) for n in args.images.split(",")):
            fn = vit_attention_layers(images)
            plain, out_plain = capture(fn)
            kernels, out_kernels = capture(fn, memset_kernels=True)
            ms = interleaved_ms({"memset nodes": plain, "kernel nodes": kernels})
            same = torch.equal(out_plain, out_kernels)
            rows[images] = {"replaced": kernels.memsets_replaced, "bit_identical": same,
                            **{name: statistics.median(v) for name, v in ms.items()}}
            print(f"{images} images: {kernels.memsets_replaced} memset nodes replaced; bit for bit {same}; "
                  + ", ".join(f"{name} {v}" for name, v in ms.items()), flush=True)
    print(f"\n{'images':>6} {'replaced':>8} {'memset nodes ms':>16} {'kernel nodes ms':>16} {'saved us/layer':>15} "
          f"{'bit for bit':>11}")
    for images, r in rows.items():
        saved = (r["memset nodes"] - r["kernel nodes"]) * 1e3 / 25
        print(f"{images:>6} {r['replaced']:>8} {r['memset nodes']:>16.4f} {r['kernel nodes']:>16.4f} {saved:>15.2f} "
              f"{str(r['bit_identical']):>11}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
