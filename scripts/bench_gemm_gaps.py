"""The idle time a DROID query's GEMMs and cuDNN attention leave before them inside a CUDA graph, under
cuBLAS's workspace settings (issue 22: the eighteenth session's trace showed a 4-byte memset before the
LLM's gate/up GEMM, the ViT's fc1 + GELU and every cuDNN SDPA call, each with ~5 us of idle device
around it: ~0.5 ms of a DROID query).

Each op runs after a small pointwise kernel that writes its input, 10 pairs in one CUDA graph (us a
pair, median of replays, the pointwise alone subtracted); one replay under the profiler counts the
memsets and names the op's kernel. Each setting runs in a process of its own (cuBLAS reads its
environment once):

    PYTHONPATH=$PWD python3 scripts/bench_gemm_gaps.py [--settings default,ws0,lt,lt_ws0,cdt,cdt_ws0] [--json F]

Beside the GEMMs: the LLM's SwiGLU pass, inductor's and a Triton kernel's at three tilings. The last row,
one DROID decoder layer compiled (the pattern kernel its attention), is what a setting buys the LLM stage,
36 layers of it. On the H200 (BENCHMARKS.md, twenty-sixth session) `ws0` dropped the GEMMs' memsets but not
the layer's time, and the Triton SwiGLU tied inductor's.
"""
import argparse
import json
import os
import subprocess
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

SETTINGS = {
    "default": {},
    "ws0": {"CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    "lt": {"TORCH_BLAS_PREFER_CUBLASLT": "1"},
    "lt_ws0": {"TORCH_BLAS_PREFER_CUBLASLT": "1", "CUBLAS_WORKSPACE_CONFIG": ":0:0", "CUBLASLT_WORKSPACE_SIZE": "0"},
    # inductor times block sizes of its own kernels (the LLM's SwiGLU pass ran at 1.5x its floor)
    "cdt": {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1"},
    "cdt_ws0": {"TORCHINDUCTOR_COORDINATE_DESCENT_TUNING": "1", "CUBLAS_WORKSPACE_CONFIG": ":0:0",
                "CUBLASLT_WORKSPACE_SIZE": "0"},
}
# molmobot-4b at DROID: LLM 945 tokens (width 2560, 32 x 128 heads, 8 kv heads, MLP 9728), ViT 4 x 729
# patches (width 1152, 16 heads of 72, MLP 4304), the context projection over 36 layers' states.
GEMMS = {   # name: (rows, K, N, bias, gelu)
    "llm gate/up": (945, 2560, 19456, False, False),
    "llm qkv": (945, 2560, 6144, False, False),
    "llm out": (945, 4096, 2560, False, False),
    "llm down": (945, 9728, 2560, False, False),
    "vit qkv": (2916, 1152, 3456, True, False),
    "vit out": (2916, 1152, 1152, True, False),
    "vit fc1+gelu": (2916, 1152, 4304, True, True),
    "vit fc2": (2916, 4304, 1152, True, False),
    "context proj": (34020, 2560, 768, False, False),
}


def ops(dev) -> dict:
    """name -> (the input the pointwise writes, the op)."""
    torch.manual_seed(0)
    out = {}
    for name, (m, k, n, bias, gelu) in GEMMS.items():
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) / k ** 0.5
        b = torch.randn(n, device=dev, dtype=torch.bfloat16) if bias else None
        if gelu:
            out[name] = (x, lambda x=x, w=w, b=b: torch._addmm_activation(b, x, w.t(), use_gelu=True))
        else:
            out[name] = (x, lambda x=x, w=w, b=b: F.linear(x, w, b))
    q, k, v = (torch.randn(4, 16, 729, 72, device=dev, dtype=torch.bfloat16) for _ in range(3))
    out["vit sdpa (cudnn)"] = (q, lambda: F.scaled_dot_product_attention(q, k, v))
    # the LLM's SwiGLU pass (silu(gate) * up of the gate/up GEMM's output): inductor's, and one Triton
    # kernel at a few tilings (inductor's ran at 19.5 us, 1.5x its 12.8 us floor, the s18 profile)
    gu = torch.randn(945, 19456, device=dev, dtype=torch.bfloat16)
    hidden = torch.empty(945, 9728, device=dev, dtype=torch.bfloat16)
    out["llm swiglu (inductor)"] = (gu, torch.compile(lambda: F.silu(gu[:, :9728]) * gu[:, 9728:], fullgraph=True))
    for block, warps in ((1024, 4), (2048, 8), (4096, 8)):
        out[f"llm swiglu {block} w{warps}"] = (gu, lambda block=block, warps=warps: swiglu(gu, hidden, block, warps))
    return out


@triton.jit
def _swiglu(GU, Out, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < N
    g = tl.load(GU + row * 2 * N + cols, mask=ok).to(tl.float32)
    u = tl.load(GU + row * 2 * N + N + cols, mask=ok).to(tl.float32)
    tl.store(Out + row * N + cols, (g * tl.sigmoid(g) * u).to(Out.dtype.element_ty), mask=ok)


def swiglu(gu: torch.Tensor, out: torch.Tensor, block: int, warps: int) -> torch.Tensor:
    n = out.shape[1]
    _swiglu[(gu.shape[0], triton.cdiv(n, block))](gu, out, N=n, BLOCK=block, num_warps=warps)
    return out


def layer_us(timed) -> float:
    """One DROID decoder layer of molmobot-4b compiled as the runtime compiles it, the pattern kernel its
    attention (bench_prefill_attention's layer)."""
    from bench_prefill_attention import decoder_layer, image_tokens

    from vla_node.runtime.kernels.pattern_attention import PatternAttention
    from vla_node.runtime.kernels.prefill_attention import flex_attend
    img = image_tokens("droid").cuda()
    layer, x, cos, sin = decoder_layer(img.numel())
    layer.attn.attend = flex_attend
    layer.compile(fullgraph=True, dynamic=False)
    mask = PatternAttention(img)   # the runtime's tiling, whatever its default
    with torch.inference_mode():
        return timed(lambda: layer(x, cos, sin, mask, mlp_out=x))


def child(setting: str) -> dict:
    sys.path.insert(0, os.path.dirname(__file__))
    from bench_prefill_attention import timed
    from torch.profiler import ProfilerActivity, profile
    rows = {}
    for name, (x, op) in ops("cuda").items():
        def pointwise(x=x):
            x.mul_(1.0)

        def pair(x=x, op=op):
            x.mul_(1.0)
            op()
        alone, both = timed(pointwise), timed(pair)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            pointwise()
            torch.cuda.synchronize()
        producer = {e.key for e in prof.key_averages()}
        graph = torch.cuda.CUDAGraph()
        pair()
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            for _ in range(10):
                pair()
        graph.replay()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            graph.replay()
            torch.cuda.synchronize()
        events = prof.key_averages()
        memsets = sum(e.count for e in events if "memset" in e.key.lower()) / 10
        kernels = sorted((e for e in events if "memset" not in e.key.lower() and e.key not in producer),
                         key=lambda e: -e.device_time_total)
        kernel_us = kernels[0].device_time_total / kernels[0].count if kernels else float("nan")
        rows[name] = {"us": both - alone, "kernel_us": kernel_us, "memsets": memsets,
                      "kernel": kernels[0].key[:70] if kernels else ""}
    rows["llm layer (compiled)"] = {"us": layer_us(timed), "kernel_us": float("nan"), "memsets": float("nan"),
                                    "kernel": ""}
    return {"setting": setting, "env": SETTINGS[setting], "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--child", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    results = []
    for setting in args.settings.split(","):
        env = {**os.environ, **SETTINGS[setting]}
        done = subprocess.run([sys.executable, __file__, "--child", setting], env=env, capture_output=True, text=True)
        if done.returncode:
            print(f"{setting}: failed\n{done.stderr[-2000:]}")
            continue
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    for r in results:
        print(f"\n{r['setting']} {r['env']}")
        print(f"{'op':18} {'us in graph':>11} {'kernel us':>9} {'memsets':>7}  kernel")
        for name, row in r["rows"].items():
            print(f"{name:18} {row['us']:11.1f} {row['kernel_us']:9.1f} {row['memsets']:7.1f}  {row['kernel']}")
    if len(results) > 1:
        print(f"\n{'op':18} " + " ".join(f"{r['setting']:>9}" for r in results) + "   (us in graph)")
        for name in results[0]["rows"]:
            print(f"{name:18} " + " ".join(f"{r['rows'][name]['us']:9.1f}" for r in results))


if __name__ == "__main__":
    main()
