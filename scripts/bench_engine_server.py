"""Several robots, one engine (issue 23): N robots each replay the rendered DROID-like stream of
the sample bag (sliding windows at 15 Hz; robot i from window i on, so no two send the same frames
at once; the server keeps each robot's vision cache apart), one request in flight as a node has,
either back to back (the most load) or every --period-ms from a random phase (a robot replanning
on its own clock: 533 ms for DROID's 8 ticks at 15 Hz). First all attached to one
vla-engine-server that batches their queries (--batch-window-ms, --max-batch), then to one that
runs them one at a time (--max-batch 1), then each with an engine process of its own (up to
--separate-max robots). Per robot the p50 / p99 latency of a query (submit to answer) and how much
of it was not its own computation (latency - the engine's stage total: the transfer, the batching
window and the wait behind the others' queries), the mean batch size its queries ran in, and the
aggregate queries per second. No ROS: each robot is a thread holding an EngineProcess (its pipe or
socket waits release the GIL).

    PYTHONPATH=$PWD python3 scripts/bench_engine_server.py --robots 1,2,4 [--mode eager] [--preset tiny]
        [--device cpu] [--layout droid] [--queries 20] [--period-ms 0] [--batch-window-ms 2]
        [--max-batch 8] [--separate-max 4] [--json F]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from vla_node.ros.engine_process import EngineProcess
from vla_node.ros.engine_protocol import WorkerOptions
from vla_node.runtime import LAYOUTS, EngineConfig
from vla_node.tools.bench import synthetic_stream

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_robots(engines: list[EngineProcess], windows: list, queries: int, period_ms: float) -> dict:
    """Every robot's `queries` queries, all robots at once: robot i sends windows i + 1, i + 2, ...
    back to back (period 0) or one every period_ms from a random phase (late ones at once)."""
    latencies = [[] for _ in engines]
    waiting = [[] for _ in engines]
    batches = [[] for _ in engines]
    phases = np.random.default_rng(0).uniform(0, period_ms / 1e3, len(engines))
    start_at = time.perf_counter() + 0.1

    def robot(i: int) -> None:
        engine = engines[i]
        for k in range(queries):
            if period_ms:
                time.sleep(max(0.0, start_at + phases[i] + k * period_ms / 1e3 - time.perf_counter()))
            t0 = time.perf_counter()
            chunk = engine.answer(engine.request(windows[(i + 1 + k) % len(windows)]))
            latencies[i].append((time.perf_counter() - t0) * 1e3)
            waiting[i].append(latencies[i][-1] - chunk.timings["total"])   # not computing its own query
            batches[i].append(chunk.batch_size)

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(len(engines))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    per = [{"p50_ms": float(np.percentile(lat, 50)), "p99_ms": float(np.percentile(lat, 99)),
            "waiting_p50_ms": float(np.percentile(q, 50)), "batch_mean": float(np.mean(b))}
           for lat, q, b in zip(latencies, waiting, batches)]
    return {"qps": len(engines) * queries / wall, "robots": per}


def start(config: EngineConfig, worker: WorkerOptions, n: int, windows: list, server: str = "") -> list[EngineProcess]:
    """n engines (attached to `server`, else each its own process), warmed up together, each
    having answered its robot's first window (a cold query, untimed)."""
    engines = [EngineProcess(config, worker, server=server) for _ in range(n)]
    for engine in engines:
        engine.spawn(1800)
    for engine in engines:
        engine.wait_ready(lambda _: None, lambda _: None, lambda: None)
    for i, engine in enumerate(engines):
        engine.predict(windows[i % len(windows)])
    return engines


def serve(config: EngineConfig, worker: WorkerOptions, windows: list, robots: list[int], queries: int,
          period_ms: float, flags: list[str], how: str) -> dict:
    """run_robots for each count of robots, all attached to one server started with `flags`."""
    results = {}
    path = os.path.join(tempfile.mkdtemp(), "engine.sock")
    server = subprocess.Popen([sys.executable, "-m", "vla_node.ros.engine_server", "--socket", path, *flags],
                              cwd=ROOT)
    attached: list[EngineProcess] = []
    try:
        while not os.path.exists(path):
            time.sleep(0.05)
        for n in robots:
            attached += start(config, worker, n - len(attached), windows[len(attached):], path)
            results[n] = run_robots(attached[:n], windows, queries, period_ms)
            print(how, n, results[n], flush=True)
    finally:
        for engine in attached:
            engine.close()
        server.terminate()
        server.wait(30)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--robots", default="1,2,4")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--mode", default="eager")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each engine process")
    ap.add_argument("--queries", type=int, default=20, help="per robot, after one untimed query each")
    ap.add_argument("--period-ms", type=float, default=0.0,
                    help="each robot queries every this many ms from a random phase (0: back to back)")
    ap.add_argument("--batch-window-ms", type=float, default=2.0, help="the batching server's window")
    ap.add_argument("--max-batch", type=int, default=8, help="the batching server's largest batch")
    ap.add_argument("--separate-max", type=int, default=4, help="most robots run with engines of their own")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    robots = sorted(int(r) for r in args.robots.split(","))
    config = EngineConfig.for_mode(args.mode, preset=args.preset, device=args.device, dtype=args.dtype,
                                   layout=LAYOUTS[args.layout])
    worker = WorkerOptions(args.mode, args.threads, 0)
    windows = [obs for obs, _ in synthetic_stream(config.layout, args.queries + max(robots) + 1)]
    results = {"config": {k: str(v) for k, v in vars(args).items()}, "batched": {}, "one_at_a_time": {},
               "separate": {}}
    batching = ["--batch-window-ms", str(args.batch_window_ms), "--max-batch", str(args.max_batch)]
    for how, flags in (("batched", batching), ("one_at_a_time", ["--max-batch", "1"])):
        results[how] = serve(config, worker, windows, robots, args.queries, args.period_ms, flags, how)
    for n in robots:
        if n > args.separate_max:
            continue
        own = start(config, worker, n, windows)
        results["separate"][n] = run_robots(own, windows, args.queries, args.period_ms)
        print("separate", n, results["separate"][n], flush=True)
        for engine in own:
            engine.close()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(f"\n{'robots':>6} {'how':13} {'q/s':>7} {'p50 ms':>8} {'p99 ms':>8} {'waiting p50':>11} {'mean batch':>10}"
          "  (worst robot)")
    for how in ("batched", "one_at_a_time", "separate"):
        for n, r in results[how].items():
            worst = max(r["robots"], key=lambda x: x["p99_ms"])
            print(f"{n:6d} {how:13} {r['qps']:7.1f} {worst['p50_ms']:8.1f} {worst['p99_ms']:8.1f} "
                  f"{worst['waiting_p50_ms']:11.1f} {worst['batch_mean']:10.2f}")


if __name__ == "__main__":
    main()
