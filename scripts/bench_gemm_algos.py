"""cuBLASLt's algorithms for a query's GEMMs, each timed, against the one torch runs (issue 22).

The thirty-fifth session's H100 profile of a DROID `fast` query: the ViT's GEMMs at 546-644 TFLOP/s (qkv
39.4 us a block at 2916 rows, its 384x104 tiles three waves for 2.06 waves of work; fc1 + GELU 49.9 us, 408
tiles of 256x128 on 132 SMs), the LLM's qkv and out at ~690, its gate/up at 790 (BENCHMARKS.md). torch
takes the first algorithm cuBLASLt's heuristic gives; this asks the heuristic for up to --algos, times each
inside a CUDA graph (10 calls a replay, median of 20 replays; scripts/bench_prefill_attention.timed) without
a workspace, as the engine runs them (workspace_free_gemms), and with 32 MiB, and checks each output
against torch's. The table says what choosing an algorithm per shape at warm-up would save a query.

    PYTHONPATH=$PWD python3 scripts/bench_gemm_algos.py [--layouts droid,8img] [--algos 32] [--json F]
"""
import argparse
import ctypes
import json
import os
import sys

import torch
import torch.nn.functional as F

from vla_node.model.config import get_preset
from vla_node.runtime.graphs import use_gemms_without_workspace

sys.path.insert(0, os.path.dirname(__file__))
from bench_prefill_attention import timed  # noqa: E402

# cublasLt.h (CUDA 12 and 13)
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 3, 4, 7, 8
OP_N, OP_T = 0, 1
EPILOGUE = {"none": 1, "bias": 4, "gelu_bias": 36}
PREF_MAX_WORKSPACE_BYTES = 1
ALGO_CONFIG = (("id", 0), ("tile", 1), ("splitk", 2), ("reduction", 3), ("swizzle", 4), ("stages", 6),
               ("cluster", 8))
WORKSPACES = {"ws0": 0, "ws32M": 32 << 20}


class Algo(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class Heuristic(ctypes.Structure):
    _fields_ = [("algo", Algo), ("workspace", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_cublaslt() -> ctypes.CDLL:
    """The libcublasLt torch itself loaded (the same build its GEMMs run)."""
    torch.ones(8, 8, device="cuda") @ torch.ones(8, 8, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if "libcublasLt" in line})
    if not paths:
        raise RuntimeError("no libcublasLt in this process")
    lib = ctypes.CDLL(paths[0])
    p, vp, sz = ctypes.POINTER, ctypes.c_void_p, ctypes.c_size_t
    lib.cublasLtMatrixLayoutCreate.argtypes = [p(vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64]
    lib.cublasLtMatmulDescCreate.argtypes = [p(vp), ctypes.c_int, ctypes.c_int]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, ctypes.c_int, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, ctypes.c_int, p(Heuristic),
                                                   p(ctypes.c_int)]
    lib.cublasLtMatmulAlgoConfigGetAttribute.argtypes = [p(Algo), ctypes.c_int, vp, sz, p(sz)]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, p(Algo), vp, sz, vp]
    return lib


def ok(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"{what}: cuBLAS status {status}")


class LtGemm:
    """out[M, N] = epilogue(x[M, K] @ w[N, K]^T + bias) through cublasLtMatmul: column-major, that is
    out^T = w (K x N, transposed) times x^T (K x M), as torch's row-major linear runs it."""

    def __init__(self, lib: ctypes.CDLL, handle, x, w, bias, epilogue: str):
        self.lib, self.handle, self.x, self.w, self.bias = lib, handle, x, w, bias
        (m, k), n = x.shape, w.shape[0]
        self.out = torch.empty(m, n, dtype=x.dtype, device=x.device)
        self.desc = ctypes.c_void_p()
        ok(lib.cublasLtMatmulDescCreate(ctypes.byref(self.desc), COMPUTE_32F, R_32F), "desc")
        for attr, value in ((DESC_TRANSA, ctypes.c_int32(OP_T)), (DESC_TRANSB, ctypes.c_int32(OP_N)),
                            (DESC_EPILOGUE, ctypes.c_uint32(EPILOGUE[epilogue]))):
            ok(lib.cublasLtMatmulDescSetAttribute(self.desc, attr, ctypes.byref(value), ctypes.sizeof(value)), "attr")
        if bias is not None:
            ptr = ctypes.c_void_p(bias.data_ptr())
            ok(lib.cublasLtMatmulDescSetAttribute(self.desc, DESC_BIAS_POINTER, ctypes.byref(ptr), 8), "bias")
        self.layouts = []
        for rows, cols in ((k, n), (k, m), (n, m)):   # w, x, out (out is C and D)
            layout = ctypes.c_void_p()
            ok(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), R_16BF, rows, cols, rows), "layout")
            self.layouts.append(layout)
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)

    def algos(self, count: int, workspace: int) -> list[Heuristic]:
        pref, size = ctypes.c_void_p(), ctypes.c_uint64(workspace)
        ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        ok(self.lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(size), 8),
           "workspace")
        results, got = (Heuristic * count)(), ctypes.c_int()
        a, b, c = self.layouts
        ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, self.desc, a, b, c, c, pref, count, results,
                                                   ctypes.byref(got)), "heuristic")
        self.lib.cublasLtMatmulPreferenceDestroy(pref)
        return [r for r in results[:got.value] if r.state == 0]

    def run(self, found: Heuristic, workspace: torch.Tensor) -> None:
        a, b, c = self.layouts
        ok(self.lib.cublasLtMatmul(self.handle, self.desc, ctypes.byref(self.alpha), self.w.data_ptr(), a,
                                   self.x.data_ptr(), b, ctypes.byref(self.beta), self.out.data_ptr(), c,
                                   self.out.data_ptr(), c, ctypes.byref(found.algo), workspace.data_ptr(),
                                   found.workspace, torch.cuda.current_stream().cuda_stream), "matmul")

    def describe(self, found: Heuristic) -> str:
        parts = []
        for name, attr in ALGO_CONFIG:
            size = ctypes.c_size_t()
            if self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(found.algo), attr, None, 0,
                                                             ctypes.byref(size)) or not 0 < size.value <= 8:
                continue
            buf = (ctypes.c_uint8 * size.value)()
            self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(found.algo), attr, buf, size.value,
                                                          ctypes.byref(size))
            parts.append(f"{name}={int.from_bytes(bytes(buf), 'little')}")
        return " ".join(parts) + f" waves={found.waves:.2f}"


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


def torch_gemm(x, w, bias, epilogue: str):
    """What the engine's compiled blocks run: linear (mm / addmm), or the ViT's fc1 with its GELU epilogue."""
    if epilogue == "gelu_bias":
        return lambda: torch._addmm_activation(bias, x, w.t(), use_gelu=True)
    return lambda: F.linear(x, w, bias)


def measure(lib, handle, name, m, k, n, epilogue, calls, count: int, workspace: torch.Tensor) -> dict:
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if epilogue != "none" else None
    reference = torch_gemm(x, w, bias, epilogue)
    want = reference().float()
    row = {"gemm": name, "m": m, "k": k, "n": n, "calls": calls, "torch_us": timed(reference)}
    gemm = LtGemm(lib, handle, x, w, bias, epilogue)
    for label, size in WORKSPACES.items():
        tried = []
        for i, found in enumerate(gemm.algos(count, size)):
            gemm.run(found, workspace)
            torch.cuda.synchronize()
            rel = ((gemm.out.float() - want).norm() / want.norm()).item()
            us = timed(lambda found=found: gemm.run(found, workspace))
            tried.append({"rank": i, "us": us, "rel_l2": rel, "config": gemm.describe(found),
                          "workspace": int(found.workspace)})
        right = [t for t in tried if t["rel_l2"] < 1e-2]
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
    lib = load_cublaslt()
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
