"""The kernels of one warm query of an engine mode (molmobot-4b, random weights) under the CUDA
profiler, heaviest first: what each stage's time is made of (issue 22, item 4: the vision stage's
LayerNorms and layout copies, the prefill's attention beside its GEMMs), then where the device sat
idle between them, by the kernel that waited (the eighteenth session's trace: a 4-byte memset before
the LLM's gate/up GEMM, the ViT's fc1 and each cuDNN attention, ~5 us of idle device each).

    python3 scripts/profile_query.py [--mode fast] [--layout droid] [--rows 40] [--out DIR]
    (--mode: a vla-bench mode with its options, e.g. fast+embedpass+inputstream)
    python3 scripts/profile_query.py --idle TRACE.json[.gz]    (the idle table of a saved trace)
"""
import argparse
import collections
import gzip
import json
import os

import torch

from vla_node.runtime import LAYOUTS, EngineConfig, PolicyEngine
from vla_node.tools.bench import mode_config


def idle_table(trace_path: str, rows: int = 12) -> None:
    """The device's idle time between the trace's kernels and memsets (gaps of 200 us or more, the
    host's, e.g. before the query's first kernel, not counted), summed by the kernel that followed it,
    largest first."""
    opener = gzip.open if trace_path.endswith(".gz") else open
    with opener(trace_path, "rt") as f:
        events = sorted((e for e in json.load(f)["traceEvents"] if e.get("cat") in ("kernel", "gpu_memset")),
                        key=lambda e: e["ts"])
    idle, memsets = collections.defaultdict(list), collections.Counter()
    waited, memset, end = 0.0, False, None   # idle (and memsets) since the last kernel ended
    for e in events:
        gap = 0.0 if end is None else e["ts"] - end
        waited = waited + gap if gap < 200 else 0.0
        end = e["ts"] + e["dur"]
        if e["cat"] == "gpu_memset":
            waited, memset = waited + e["dur"], True
            continue
        if gap or waited:
            idle[e["name"]].append(waited)
        memsets[e["name"]] += memset
        waited, memset = 0.0, False
    busy = sum(e["dur"] for e in events if e["cat"] == "kernel")
    total = sum(sum(v) for v in idle.values())
    print(f"device idle between kernels: {total:.1f} us beside {busy:.1f} us of kernels")
    print(f"{'idle us':>8} {'calls':>6} {'median':>7} {'memsets':>7}  kernel that waited")
    for name, gaps in sorted(idle.items(), key=lambda kv: -sum(kv[1]))[:rows]:
        print(f"{sum(gaps):8.1f} {len(gaps):6d} {sorted(gaps)[len(gaps) // 2]:7.2f} {memsets[name]:7d}  {name[:90]}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", default="fast")
    ap.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    ap.add_argument("--rows", type=int, default=40)
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--idle", default=None, help="a saved trace: print its idle table only")
    args = ap.parse_args()
    if args.idle:
        idle_table(args.idle)
        return
    base = EngineConfig(preset="molmobot-4b", device="cuda", dtype="bfloat16", layout=LAYOUTS[args.layout])
    engine = PolicyEngine(mode_config(args.mode, base), progress=print)
    engine.warmup()
    obs = engine.dummy_observation()
    for _ in range(3):
        print("stages ms", {k: round(v, 2) for k, v in engine.predict(obs).timings.items()})
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.predict(obs)
    os.makedirs(args.out, exist_ok=True)
    trace = os.path.join(args.out, f"trace_{args.mode}_{args.layout}.json")
    prof.export_chrome_trace(trace)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:args.rows]
    print(f"{'us':>9} {'calls':>6}  kernel (one warm query, heaviest first)")
    for e in events:
        print(f"{e.device_time_total:9.1f} {e.count:6d}  {e.key[:100]}")
    idle_table(trace)


if __name__ == "__main__":
    main()
