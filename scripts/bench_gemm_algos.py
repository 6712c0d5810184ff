"""cuBLASLt's algorithms for a query's GEMMs, each timed, against the one torch runs (issue 22).

The thirty-fifth session's H100 profile of a DROID `fast` query: the ViT's GEMMs at 546-644 TFLOP/s (qkv
39.4 us a block at 2916 rows, its 384x104 tiles three waves for 2.06 waves of work; fc1 + GELU 49.9 us, 408
tiles of 256x128 on 132 SMs), the LLM's qkv and out at ~690, its gate/up at 790 (BENCHMARKS.md). torch's
GEMMs run the kernel cuBLAS's heuristic picks; this asks cuBLASLt's heuristic for up to --algos, times each
inside a CUDA graph (10 calls a replay, median of 20 replays; runtime/graphs.graph_us) without
a workspace, as the engine runs them (workspace_free_gemms), and with 32 MiB, and checks each output
against torch's. The table says what choosing an algorithm per shape at warm-up would save a query (what
runtime/lt_gemm does in the engine under tuned_gemms, with the same LtGemm).

    PYTHONPATH=$PWD python3 scripts/bench_gemm_algos.py [--layouts droid,8img] [--algos 32] [--json F]
"""
import argparse
import ctypes
import json
import sys

import torch

from vla_node.model.config import get_preset
from vla_node.runtime.graphs import graph_us, use_gemms_without_workspace
from vla_node.runtime.lt_gemm import AGREEMENT, LtGemm, alignment, load_cublaslt, ok, torch_linear

WORKSPACES = {"ws0": 0, "ws32M": 32 << 20}


def query_gemms(layout: str) -> list[tuple[str, int, int, int, str, int]]:
    """(name, M, K, N, epilogue, calls a query) of molmobot-4b's LLM and ViT GEMMs at `layout`: DROID's
    896-token bucket (the 48-token tier at whole tiles) over 4 images, or 8 images' 1745 tokens."""
    cfg = get_preset("molmobot-4b")
    llm, vit = cfg.llm, cfg.vision
    tokens, images = {"droid": (896, 4), "8img": (1745, 8)}[layout]
    patches = images * vit.grid * vit.grid
    q, kv = llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim
    return [("llm gate/up", tokens, llm.dim, 2 * llm.mlp, "none", llm.layers),
            ("llm qkv", tokens, llm.dim, q + 2 * kv, "none", llm.layers),
            ("llm out", tokens, q, llm.dim, "none", llm.layers),
            ("llm down", tokens, llm.mlp, llm.dim, "none", llm.layers),
            ("vit qkv", patches, vit.width, 3 * vit.width, "bias", vit.layers_run),
            ("vit out", patches, vit.width, vit.width, "bias", vit.layers_run),
            ("vit fc1+gelu", patches, vit.width, vit.mlp, "gelu_bias", vit.layers_run),
            ("vit fc2", patches, vit.mlp, vit.width, "bias", vit.layers_run)]


def measure(lib, handle, name, m, k, n, epilogue, calls, count: int, workspace: torch.Tensor) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if epilogue != "none" else None
    gelu = epilogue == "gelu_bias"
    want = torch_linear(x, w, bias, gelu).float()
    row = {"gemm": name, "m": m, "k": k, "n": n, "calls": calls,
           "torch_us": graph_us(lambda: torch_linear(x, w, bias, gelu), replays=20)}
    gemm, out = LtGemm(lib, handle, m, k, n, x.dtype, epilogue), torch.empty(m, n, device="cuda", dtype=x.dtype)
    for label, size in WORKSPACES.items():
        tried = []
        for i, found in enumerate(gemm.algos(count, alignment(x, w, bias, out), bias, size)):
            gemm(found, x, w, bias, out, workspace)
            torch.cuda.synchronize()
            rel = ((out.float() - want).norm() / want.norm()).item()
            us = graph_us(lambda found=found: gemm(found, x, w, bias, out, workspace), replays=20)
            tried.append({"rank": i, "us": us, "rel_l2": rel, "config": gemm.describe(found),
                          "workspace": int(found.workspace)})
        right = [t for t in tried if t["rel_l2"] < AGREEMENT]
        row[label] = {"algos": len(tried), "wrong": len(tried) - len(right), "tried": tried,
                      "first": tried[0] if tried else None, "best": min(right, key=lambda t: t["us"], default=None)}
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default="droid,8img")
    ap.add_argument("--algos", type=int, default=32, help="algorithms asked of cuBLASLt's heuristic per GEMM")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gemm_algos needs a CUDA device")
    use_gemms_without_workspace()   # before the first GEMM: torch's as the engine runs them
    lib, _ = load_cublaslt()
    handle = ctypes.c_void_p()
    ok(lib.cublasLtCreate(ctypes.byref(handle)), "cublasLtCreate")
    workspace = torch.empty(max(WORKSPACES.values()), dtype=torch.uint8, device="cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.algos} algorithms asked a GEMM")
    rows = {}
    for layout in args.layouts.split(","):
        rows[layout] = [measure(lib, handle, *gemm, args.algos, workspace) for gemm in query_gemms(layout)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(f"{'layout':7} {'gemm':13} {'M x K x N':>18} {'torch':>7} {'lt #0':>7} {'best ws0':>8} {'best 32M':>8} "
          f"{'algos':>6} {'saves ms/query':>14}  best ws0 config")
    for layout, table in rows.items():
        saved = 0.0
        for r in table:
            first, best, best32 = r["ws0"]["first"], r["ws0"]["best"], r["ws32M"]["best"]
            gain = r["calls"] * max(0.0, r["torch_us"] - best["us"]) / 1e3 if best else 0.0
            saved += gain
            print(f"{layout:7} {r['gemm']:13} {r['m']:>6}x{r['k']:>5}x{r['n']:>5} {r['torch_us']:7.1f} "
                  f"{first['us'] if first else float('nan'):7.1f} {best['us'] if best else float('nan'):8.1f} "
                  f"{best32['us'] if best32 else float('nan'):8.1f} {r['ws0']['algos']:>3}/{r['ws0']['wrong']:<2} "
                  f"{gain:14.3f}  {best['config'] if best else '-'}")
        print(f"{layout:7} the best algorithm of each GEMM without a workspace saves {saved:.3f} ms a query")


if __name__ == "__main__":
    main()
