"""The kernels of one warm query of an engine mode (molmobot-4b, random weights) under the CUDA
profiler, heaviest first: what each stage's time is made of (issue 22, item 4: the vision stage's
LayerNorms and layout copies, the prefill's attention beside its GEMMs).

    python3 scripts/profile_query.py [--mode fast] [--layout droid] [--rows 40] [--out DIR]
"""
import argparse
import os

import torch

from vla_node.runtime import LAYOUTS, EngineConfig, PolicyEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fast")
    ap.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = ap.parse_args()
    engine = PolicyEngine(EngineConfig.for_mode(args.mode, preset="molmobot-4b", device="cuda", dtype="bfloat16",
                                                layout=LAYOUTS[args.layout]), progress=print)
    engine.warmup()
    obs = engine.dummy_observation()
    for _ in range(3):
        print("stages ms", {k: round(v, 2) for k, v in engine.predict(obs).timings.items()})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.predict(obs)
    os.makedirs(args.out, exist_ok=True)
    prof.export_chrome_trace(os.path.join(args.out, f"trace_{args.mode}_{args.layout}.json"))
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:args.rows]
    print(f"{'us':>9} {'calls':>6}  kernel (one warm query, heaviest first)")
    for e in events:
        print(f"{e.device_time_total:9.1f} {e.count:6d}  {e.key[:100]}")


if __name__ == "__main__":
    main()
