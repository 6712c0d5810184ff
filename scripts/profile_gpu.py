"""Where the time goes on the GPU, and what the candidate fixes buy: stage kernels of the 4B
query under the profiler, and one flow step / one layer of each stage timed as CUDA-graph
replays (no launch overhead) for each variant.

    python3 scripts/profile_gpu.py [--layout 8img] [--out DIR]
"""
import argparse
import copy
import json
import os

import torch
from triton.testing import do_bench

from vla_node.runtime import LAYOUTS, EngineConfig, PolicyEngine
from vla_node.runtime.graphs import capture
from vla_node.runtime.kernels.few_query_attention import few_query_attention


def graph_ms(fn, reps: int = 20) -> float:
    """Median ms of `fn` captured in a CUDA graph."""
    return do_bench(capture(fn)[0].replay, warmup=5, rep=reps, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", default="8img")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    res = {}
    engine = PolicyEngine(EngineConfig.for_mode("compile", preset="molmobot-4b", device="cuda", dtype="bfloat16",
                                                layout=LAYOUTS[args.layout], triton_attention=True), progress=print)
    engine.warmup()
    obs = engine.dummy_observation()
    if args.profile:
        for _ in range(2):
            engine.predict(obs)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            engine.predict(obs)
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30, max_name_column_width=60)
        open(os.path.join(args.out, "profile_triton.txt"), "w").write(table)
        print(table)
    m, st = engine.model, engine.static
    b = st.bucket(engine.layout)
    engine.predict(obs)
    dev, dt = "cuda", torch.bfloat16
    x = torch.randn(1, 16, 8, device=dev, dtype=dt)
    blocks = m.expert.blocks
    with torch.inference_mode():
        step = lambda: m.expert.velocity(x, st.mod_table[0], b.kv, b.ctx_mask)  # noqa: E731
        res["step_compiled_triton_ms"] = graph_ms(step)
        for blk in blocks:
            blk.attend = torch.nn.functional.scaled_dot_product_attention
        res["step_compiled_sdpa_ms"] = graph_ms(step)
        for blk in blocks:
            blk.attend = few_query_attention
        # max-autotune for the expert's M=16 GEMMs: one block compiled that way, timed x36.
        auto = copy.deepcopy(blocks[0])
        auto._compiled_call_impl = None
        auto.compile(mode="max-autotune-no-cudagraphs", fullgraph=True, dynamic=False)
        h = torch.randn(1, 16, 768, device=dev, dtype=dt)
        k, v = b.kv[0]
        import time
        t0 = time.perf_counter()
        auto(h, st.mod_table[0][0][0], k, v, b.ctx_mask)
        res["autotune_compile_s"] = time.perf_counter() - t0
        res["block_autotune_x36_ms"] = graph_ms(lambda: [auto(h, st.mod_table[0][0][0], k, v, b.ctx_mask)
                                                         for _ in range(36)])
        res["block_default_x36_ms"] = graph_ms(lambda: [blocks[0](h, st.mod_table[0][0][0], k, v, b.ctx_mask)
                                                        for _ in range(36)])
        vit = m.vision.encoder.blocks[0]
        xi = torch.randn(8, 729, 1152, device=dev, dtype=dt)
        res["vit_block_ms"] = graph_ms(lambda: vit(xi, xi))   # a middle block: the MLP output before it added in
        layer = m.llm.layers[0]
        xl = torch.randn(1, b.length, 2560, device=dev, dtype=dt)
        res["llm_layer_ms"] = graph_ms(lambda: layer(xl, b.cos, b.sin, b.attn_mask, mlp_out=xl))   # a middle layer
        res["vision_stage_ms"] = graph_ms(lambda: st._vision_stage(8))
        res["prefill_stage_ms"] = graph_ms(lambda: st._prefill_stage(b))
    json.dump(res, open(os.path.join(args.out, "micro.json"), "w"), indent=2)
    for key, val in res.items():
        print(f"{key:<30} {val:.4g}")


if __name__ == "__main__":
    main()
