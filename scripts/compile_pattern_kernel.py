"""Compile the prefill's pattern kernel (runtime/kernels/pattern_attention.py) for the H100/H200
(sm_90) with no GPU, as molmobot-4b's layer launches it at the DROID prompt, at each tiling given:
its shared memory a program, and whether that holds num_stages K and V tiles besides q's (Triton
pipelined the loads; an index loaded in the same iteration as the loads it addresses once stopped
that). The interpreter, which runs the CPU tests, pipelines nothing and accepts code the GPU compiler
rejects, so the suite runs this; --ptxas adds registers, spills and SASS counts. Exits 1 if a
tiling's loads are not pipelined.

    python scripts/compile_pattern_kernel.py [--tiles 64,64,4,3 128,64,8,2] [--dtype bfloat16] [--ptxas] [--q-rope]
"""
import argparse
import sys

import torch
from compile_flow_kernel import compile_for_hopper, ptxas_report
from triton.runtime.jit import JITFunction

from vla_node.model import get_preset
from vla_node.runtime.kernels.pattern_attention import PatternAttention, pattern_attention


def recorded_launch(tiles: tuple[int, int, int, int, bool], dtype: torch.dtype, tokens: int,
                    q_rope: bool = False) -> tuple:
    """(kernel, args, kwargs) of one layer's call (meta tensors: recorded, not launched). q_rope: as
    q_rope_in_attention launches it, q, k and v views of one fused projection, q normed and rotated
    in the kernel."""
    launches = []
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    llm = get_preset("molmobot-4b").llm
    block_m, block_n, num_warps, num_stages, tma = tiles
    with torch.device("meta"):
        q = torch.empty(1, llm.heads, tokens, llm.head_dim, dtype=dtype)
        k = v = torch.empty(1, llm.kv_heads, tokens, llm.head_dim, dtype=dtype)
        rope = None
        if q_rope:
            fused = torch.empty(1, tokens, (llm.heads + 2 * llm.kv_heads) * llm.head_dim, dtype=dtype)
            q, _, v = (x.view(1, tokens, -1, llm.head_dim).transpose(1, 2) for x in fused.split(
                (llm.heads * llm.head_dim, llm.kv_heads * llm.head_dim, llm.kv_heads * llm.head_dim), -1))
            tables = torch.empty(tokens, llm.head_dim)
            rope = (torch.empty(llm.head_dim, dtype=dtype), tables, tables, llm.norm_eps)
        p = PatternAttention(torch.zeros(tokens, dtype=torch.bool), block_m=block_m, block_n=block_n,
                             num_warps=num_warps, num_stages=num_stages, tma=tma)
        pattern_attention(q, k, v, p.image, p.tiles, p.counts, p.order, 0, *p.launch, rope)
    return launches[0]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiles", nargs="+", default=["64,64,4,3"],
                    help="BLOCK_M,BLOCK_N,num_warps,num_stages[,tma 1 (default) / 0]")
    ap.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    ap.add_argument("--tokens", type=int, default=945, help="the prompt's length (DROID's)")
    ap.add_argument("--ptxas", action="store_true", help="print registers, spills and SASS counts")
    ap.add_argument("--q-rope", action="store_true", help="as q_rope_in_attention launches it")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    unpipelined = 0
    for spec in args.tiles:
        numbers = [int(n) for n in spec.split(",")]
        tiles = (*numbers[:4], bool((*numbers, 1)[4]))   # tma unless a fifth number 0 says otherwise
        block_m, block_n, _, num_stages, tma = tiles
        compiled = compile_for_hopper(*recorded_launch(tiles, dtype, args.tokens, args.q_rope))
        tile_bytes = get_preset("molmobot-4b").llm.head_dim * dtype.itemsize
        pipelined = compiled.metadata.shared >= (block_m + 2 * num_stages * block_n) * tile_bytes
        unpipelined += not pipelined
        report = f"; {ptxas_report(compiled.asm['ptx'])}" if args.ptxas else ""
        print(f"{block_m}x{block_n} w{tiles[2]} s{num_stages}{' tma' * tma} {args.dtype}: {compiled.metadata.shared} "
              f"bytes of shared memory, loads {'pipelined' if pipelined else 'NOT pipelined'}{report}", flush=True)
    sys.exit(1 if unpipelined else 0)


if __name__ == "__main__":
    main()
