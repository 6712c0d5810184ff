"""Two engine modes side by side in one process, their queries paired: A B B A, A B B A, ... on the same
observation (molmobot-4b, random weights, page-locked frames as vla-bench gives them), so that drift
of clocks and temperature falls on both alike. For each stage and the total: A's and B's medians and
the median of the pairs' differences (B - A), with how many pairs B was faster in. A difference of
tens of us, which separate vla-bench runs (their medians ~0.1 ms apart) cannot show, shows here.

    PYTHONPATH=$PWD python3 scripts/ab_query.py --a fast --b fast+embedpass+inputstream+qrope [--layout droid]
        [--pairs 40] [--json F]
"""
import argparse
import json
import statistics

import torch

from vla_node.runtime import LAYOUTS, EngineConfig, PolicyEngine
from vla_node.tools.bench import STAGES, gemms_without_workspace_if_any, machine, mode_config, page_locked

PARTS = (*STAGES, "total")


def paired_timings(engines: dict, obs, noise, pairs: int) -> dict[str, list[dict]]:
    """Each engine's timings of `pairs` queries, run A B B A, A B B A, ..."""
    times = {name: [] for name in engines}
    order = list(engines)
    for i in range(pairs):
        for name in (order if i % 2 == 0 else order[::-1]):
            times[name].append(engines[name].predict(obs, noise=noise).timings)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", default="fast")
    ap.add_argument("--b", required=True)
    ap.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    ap.add_argument("--preset", default="molmobot-4b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pairs", type=int, default=40)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    base = EngineConfig(preset=args.preset, device=args.device, dtype="bfloat16" if cuda else "float32",
                        layout=LAYOUTS[args.layout])
    configs = {"A": mode_config(args.a, base), "B": mode_config(args.b, base)}
    gemms_without_workspace_if_any(list(configs.values()))
    engines = {}
    for name, cfg in configs.items():
        engines[name] = PolicyEngine(cfg, progress=lambda m, name=name: print(f"[{name}] {m}", flush=True))
        engines[name].warmup()
    obs = engines["A"].dummy_observation()
    noise = torch.randn((1, 16, 8), generator=torch.Generator().manual_seed(0)).to(engines["A"].device)
    if cuda:
        (obs, _), = page_locked([(obs, noise)])
    outs = {name: e.predict(obs, noise=noise).normalized for name, e in engines.items()}
    times = paired_timings(engines, obs, noise, args.pairs)
    rows = {}
    for part in PARTS:
        a, b = ([t[part] for t in times[n]] for n in ("A", "B"))
        diffs = [y - x for x, y in zip(a, b)]
        rows[part] = {"A_ms": statistics.median(a), "B_ms": statistics.median(b),
                      "median_diff_us": statistics.median(diffs) * 1e3, "B_faster": sum(d < 0 for d in diffs)}
    dev = float(abs(outs["A"] - outs["B"]).max())
    print(f"\nA = {args.a}, B = {args.b}: {args.layout}, {args.pairs} pairs (A B B A ...), max |A - B| {dev:.3g}")
    print(f"{'':>10} {'A ms':>9} {'B ms':>9} {'B - A us':>9} {'B faster':>9}")
    for part, r in rows.items():
        print(f"{part:>10} {r['A_ms']:>9.3f} {r['B_ms']:>9.3f} {r['median_diff_us']:>9.1f} "
              f"{r['B_faster']:>5}/{args.pairs}")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine(), "a": args.a, "b": args.b, "layout": args.layout, "pairs": args.pairs,
                       "max_abs_diff": dev, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
