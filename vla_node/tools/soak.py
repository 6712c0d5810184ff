"""vla-soak: does anything grow or leak over many queries? (A benchmark, not a test.)

    vla-soak node --queries 10000 --json out/soak_node.json          # CPU: the node, config/tiny.yaml
    vla-soak engine --device cuda --preset molmobot-4b --mode fast --queries 1000 --json out/soak_gpu.json

`node`: the real node (vla-node with config/tiny.yaml) fed two 640x480 cameras, moving joint
states and a changing instruction, replanning after every chunk (replan_threshold = horizon), so
queries run back to back. Sampled along the way from /proc: resident memory, open file
descriptors and threads of the node process and of its engine process. Before start and after
the node has stopped: the Fast DDS shared-memory files in /dev/shm and the processes it started.
Goals: resident memory of each process grows < 5 % from the end of the warm-up to the end, no
file descriptor or thread is gained, nothing is left behind.

`engine`: the engine alone, no ROS (the GPU machine has none): `--queries` varied queries
(fresh frames sliding through the window, random states, instructions of different lengths, a
new episode every 200), counting dynamo compilations after warm-up (goal: 0), device memory and
resident memory growth.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import numpy as np

from ..ros.diagnostics import Key
from .node_process import dds_shm_of, dead_dds_shm, interrupt, node_argv, processes_with_env, ros_environment
from .stats import summary

CONFIG = Path(__file__).resolve().parents[2] / "config" / "tiny.yaml"
HOME = [0.0, -0.5, 0.0, -2.0, 0.0, 1.5, 0.8, 0.5]
# Different lengths, all within the default token budget of 48.
INSTRUCTIONS = ["pick up the red cup", "put the red cup in the bowl",
                "open the top drawer, take out the blue block and place it on the table next to the bowl",
                "stack the green block on the yellow one", "wipe the table", "close the drawer slowly"]
GROWTH_GOAL_PCT = 5.0


# -- /proc ------------------------------------------------------------------------------------------
def process_sample(pid: int) -> dict:
    """Resident memory (MiB), open file descriptors and threads of a live process."""
    status = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mib": int(status["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(status["Threads"])}


def growth(samples: list[dict], baseline_at: int) -> dict:
    """RSS growth from the first sample at or after `baseline_at` queries to the last, and the
    change in file descriptors and threads."""
    base = next(s for s in samples if s["queries"] >= baseline_at)
    last = samples[-1]
    return {"baseline_queries": base["queries"], "final_queries": last["queries"],
            "rss_mib": [base["rss_mib"], last["rss_mib"]],
            "rss_growth_pct": 100 * (last["rss_mib"] - base["rss_mib"]) / base["rss_mib"],
            "fds": [base["fds"], last["fds"]], "threads": [base["threads"], last["threads"]]}


# -- the node ---------------------------------------------------------------------------------------
def soak_node(args) -> dict:
    from .node_bench import Feeder

    domain = ros_environment()
    marker = f"{os.getpid()}-{time.time_ns()}"
    namespace = f"/soak{os.getpid()}"
    command = node_argv(args.params, {"autostart": True, "replan_threshold": 16, "control_rate_hz": args.rate,
                                      "engine_threads": args.threads},
                        ["-r", f"__ns:={namespace}"])
    log_path = Path(os.environ["ROS_LOG_DIR"]) / f"soak_{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    print(f"soak: {args.queries} queries through {namespace}/vla_node (ROS domain {domain}, log {log_path})",
          flush=True)
    started = time.monotonic()
    with open(log_path, "w") as log:
        node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "VLA_SOAK": marker})
        # Every joint moves on its own slow sine: each query sees another state.
        feeder = Feeder(namespace, args.camera_hz, args.joint_hz, 480, 640,
                        joints=lambda t: [q + 0.2 * math.sin(0.3 * t + i) for i, q in enumerate(HOME)])
        instruction_pub = feeder.node.create_publisher(_string_type(), f"{namespace}/instruction", 10)
        samples: list[dict] = []
        ours: set[str] = set()
        try:
            samples = _drive(args, node, feeder, instruction_pub, log_path)
            # The Fast DDS files of this run: both participants' own, and each other's they map.
            ours = dds_shm_of(node.pid) | dds_shm_of(os.getpid())
        finally:
            feeder.close()
            exit_code = interrupt(node, 30)
    seconds = time.monotonic() - started
    deadline = time.monotonic() + 10
    while (left := processes_with_env("VLA_SOAK", marker)) and time.monotonic() < deadline:
        time.sleep(0.1)
    leaked_shm = dead_dds_shm(ours)     # still there with their owner gone: they would stay forever
    report = {"queries": samples[-1]["queries"], "seconds": seconds, "node_exit_code": exit_code,
              "node": growth([s["node"] | {"queries": s["queries"]} for s in samples], args.warmup),
              "engine": growth([s["engine"] | {"queries": s["queries"]} for s in samples], args.warmup),
              "processes_left": left, "dds_shm_checked": sorted(ours), "dds_shm_leaked": leaked_shm,
              "samples": samples}
    report["goals_met"] = bool(report["queries"] >= args.queries and exit_code == 0 and not left and not leaked_shm
                               and all(report[p]["rss_growth_pct"] < GROWTH_GOAL_PCT
                                       and report[p]["fds"][1] <= report[p]["fds"][0]
                                       and report[p]["threads"][1] <= report[p]["threads"][0]
                                       for p in ("node", "engine")))
    return report


def _string_type():
    from std_msgs.msg import String
    return String


def _drive(args, node: subprocess.Popen, feeder, instruction_pub, log_path: Path) -> list[dict]:
    """Until the node has answered args.queries queries: a new instruction every 100 queries, a
    sample every args.sample_every."""
    String = _string_type()
    samples: list[dict] = []
    next_sample, next_instruction = 0, 0
    deadline = time.monotonic() + args.timeout_s
    while True:
        if node.poll() is not None:
            raise SystemExit(f"vla-soak: the node exited with code {node.returncode}; its log: {log_path}")
        if time.monotonic() > deadline:
            raise SystemExit(f"vla-soak: {args.queries} queries not done in {args.timeout_s:.0f} s; "
                             f"last diagnostics: {feeder.diagnostics}")
        d = dict(feeder.diagnostics)
        if not d.get(Key.ENGINE_PID, "").isdigit():     # not configured yet
            time.sleep(0.5)
            continue
        queries = int(d[Key.REQUESTS])
        if queries >= next_instruction:
            instruction_pub.publish(String(data=INSTRUCTIONS[(next_instruction // 100) % len(INSTRUCTIONS)]))
            next_instruction += 100
        if queries >= next_sample:
            samples.append({"queries": queries, "t_s": time.monotonic(), "node": process_sample(node.pid),
                            "engine": process_sample(int(d[Key.ENGINE_PID])), "holds": d.get(Key.HOLDS_BY_CAUSE)})
            s = samples[-1]
            print(f"  {queries:6d} queries: node {s['node']['rss_mib']:.1f} MiB, {s['node']['fds']} fds, "
                  f"{s['node']['threads']} threads; engine {s['engine']['rss_mib']:.1f} MiB, {s['engine']['fds']} fds, "
                  f"{s['engine']['threads']} threads", flush=True)
            next_sample = queries + args.sample_every
            if queries >= args.queries:
                return samples
        time.sleep(0.5)


# -- the engine alone -------------------------------------------------------------------------------
def varied_queries(engine, count: int, seed: int = 0):
    """(Observation, noise) pairs: the window slides by one frame time per query (so frames are
    shared with the previous window, as on a robot), every frame new random pixels, a random state
    within the checkpoint's statistics (the engine's dummy observation), instructions of different
    lengths, a new episode (frame ids and the engine's stream state reset) every 200 queries."""
    import torch

    from ..runtime import Observation

    layout, config = engine.layout, engine.config
    rng = np.random.default_rng(seed)
    frames: dict = {}
    for q in range(count):
        t = q % 200                                       # frame time within the episode
        if t == 0:
            engine.reset_stream()
            frames.clear()
        times = [t + k * layout.stride for k in range(layout.frames)]
        ids = [(camera, f"{q // 200}:{f}") for f in times for camera in layout.cameras]
        for frame_id in ids:
            if frame_id not in frames:
                frames[frame_id] = rng.integers(0, 256, (config.camera_height, config.camera_width, 3), np.uint8)
        for old in [i for i in frames if i not in ids]:
            del frames[old]
        state = engine.dummy_observation(seed=seed + q).state.astype(np.float32)
        noise = torch.randn((1, engine.model_cfg.action.horizon, engine.model_cfg.action.action_dim),
                            generator=torch.Generator().manual_seed(q))
        yield Observation(images=[frames[i] for i in ids], state=state, instruction=INSTRUCTIONS[q % len(INSTRUCTIONS)],
                          stamp=times[-1] / 15.0, frame_ids=ids), noise


def soak_engine(args) -> dict:
    import torch

    from ..runtime import LAYOUTS, EngineConfig, PolicyEngine
    from ..runtime.compile import compile_count
    from .bench import mode_config

    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    base = EngineConfig(preset=args.preset, checkpoint=args.checkpoint, device=args.device, dtype=dtype,
                        layout=LAYOUTS[args.layout])
    engine = PolicyEngine(mode_config(args.mode, base), progress=lambda m: print(f"  {m}", flush=True))
    engine.warmup()
    compiled_at_ready = compile_count()
    samples = []

    def sample(queries: int) -> None:
        s = {"queries": queries, **process_sample(os.getpid())}
        if cuda:
            s["cuda_allocated_mib"] = torch.cuda.memory_allocated() / 2**20
            s["cuda_reserved_mib"] = torch.cuda.memory_reserved() / 2**20
        s["recompiles"] = compile_count() - compiled_at_ready
        samples.append(s)
        print(f"  {queries:6d} queries: {s['rss_mib']:.1f} MiB resident, {s['recompiles']} recompiles"
              + (f", {s['cuda_allocated_mib']:.0f} MiB on the device" if cuda else ""), flush=True)

    started = time.monotonic()
    latencies = []
    for q, (obs, noise) in enumerate(varied_queries(engine, args.queries), start=1):
        chunk = engine.predict(obs, noise=noise.to(engine.device))
        latencies.append(chunk.timings["total"])
        if not np.isfinite(chunk.actions).all():
            raise SystemExit(f"vla-soak: query {q} gave non-finite actions")
        if q == 1 or q % args.sample_every == 0 or q == args.queries:
            sample(q)
    engine.close()
    report = {"queries": args.queries, "seconds": time.monotonic() - started, "mode": args.mode, "device": args.device,
              "dtype": dtype, "preset": args.preset, "recompiles": samples[-1]["recompiles"],
              "latency_ms": summary(latencies, "p50", "p99"),
              "process": growth(samples, min(args.warmup, args.queries)), "samples": samples}
    if cuda:
        base_sample = next(s for s in samples if s["queries"] >= min(args.warmup, args.queries))
        report["cuda_allocated_mib"] = [base_sample["cuda_allocated_mib"], samples[-1]["cuda_allocated_mib"]]
    report["goals_met"] = report["recompiles"] == 0 and report["process"]["rss_growth_pct"] < GROWTH_GOAL_PCT and \
        (not cuda or report["cuda_allocated_mib"][1] <= report["cuda_allocated_mib"][0])
    return report


# -- command line -----------------------------------------------------------------------------------
def print_report(report: dict) -> None:
    def line(name: str, g: dict) -> str:
        return (f"  {name}: resident {g['rss_mib'][0]:.1f} -> {g['rss_mib'][1]:.1f} MiB ({g['rss_growth_pct']:+.2f} %) "
                f"from query {g['baseline_queries']} to {g['final_queries']}; fds {g['fds'][0]} -> {g['fds'][1]}; "
                f"threads {g['threads'][0]} -> {g['threads'][1]}")

    print(f"{report['queries']} queries in {report['seconds']:.0f} s")
    for name in ("node", "engine", "process"):
        if name in report:
            print(line(name, report[name]))
    if "dds_shm_leaked" in report:
        print(f"  left behind: processes {report['processes_left'] or 'none'}, Fast DDS shared memory "
              f"{report['dds_shm_leaked'] or 'none'} (of the {len(report['dds_shm_checked'])} files this run's "
              f"participants mapped); node exit code {report['node_exit_code']}")
    if "recompiles" in report:
        print(f"  recompiles after warm-up: {report['recompiles']}; latency p50 {report['latency_ms']['p50']:.1f} / "
              f"p99 {report['latency_ms']['p99']:.1f} ms"
              + (f"; device memory {report['cuda_allocated_mib'][0]:.0f} -> {report['cuda_allocated_mib'][1]:.0f} MiB"
                 if "cuda_allocated_mib" in report else ""))
    print(f"  goals ({GROWTH_GOAL_PCT:g} % growth, nothing gained or left behind"
          f"{', 0 recompiles' if 'recompiles' in report else ''}): {'met' if report['goals_met'] else 'MISSED'}")


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="vla-soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    node = sub.add_parser("node", help="queries through the node (CPU, tiny model)")
    node.add_argument("--params", type=Path, default=CONFIG)
    node.add_argument("--rate", type=float, default=50.0, help="control rate (Hz)")
    node.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    node.add_argument("--camera-hz", type=float, default=15.0)
    node.add_argument("--joint-hz", type=float, default=100.0)
    node.add_argument("--timeout-s", type=float, default=7200.0)
    engine = sub.add_parser("engine", help="queries through the engine alone (no ROS; the GPU machine)")
    engine.add_argument("--preset", default="tiny")
    engine.add_argument("--checkpoint", default=None)
    engine.add_argument("--device", default="cpu")
    engine.add_argument("--dtype", default=None, help="float32 | bfloat16 (default: bf16 on CUDA, fp32 on CPU)")
    engine.add_argument("--mode", default="eager", help="an engine mode, optionally +options (as vla-bench --modes)")
    engine.add_argument("--layout", default="droid")
    # The node's rolling statistics and the allocator settle within ~2000 queries (measured:
    # resident memory flat from 2045 to 10257 queries, BENCHMARKS.md).
    for p, queries, warmup in ((node, 10000, 2000), (engine, 1000, 100)):
        p.add_argument("--queries", type=int, default=queries)
        p.add_argument("--warmup", type=int, default=warmup,
                       help="queries before the baseline sample (allocator caches, rolling statistics)")
        p.add_argument("--sample-every", type=int, default=max(1, queries // 20))
        p.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    report = soak_node(args) if args.what == "node" else soak_engine(args)
    report["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "load_average_after": os.getloadavg()}
    report["args"] = {k: str(v) for k, v in vars(args).items()}
    print_report(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["goals_met"] else 1


if __name__ == "__main__":
    sys.exit(main())
