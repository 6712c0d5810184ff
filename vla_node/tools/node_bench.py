"""vla-node-bench: the node's real-time behaviour on this machine (a benchmark, not a test).

    python -m vla_node.tools.node_bench --json out/node_bench.json

1. `where`: why the engine runs in its own process. A 50 Hz rclpy timer publishing a command,
   alone, then while the tiny model infers back to back in a thread of the same process, then
   in a separate process (niced, one torch thread: what the node does). Period jitter p50/p99.
2. `node`: the real node (vla-node --ros-args --params-file config/tiny.yaml) fed two 640x480
   rgb8 cameras and joint states from this process: command period jitter as the node measures
   its control ticks and as received here, engine latency per stage, and the node's overhead
   beyond engine.predict() per observation, all from its /diagnostics.

Jitter = |period - 1/rate|. Beside every measurement a plain sleep loop runs in a process of its
own: the machine's floor at that moment (on a shared or virtual machine it moves a lot).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from ..ros.diagnostics import OVERHEAD_PARTS, Key
from .node_process import interrupt, node_argv, ros_domain, ros_environment
from .stats import summary

CONFIG = Path(__file__).resolve().parents[2] / "config" / "tiny.yaml"
JOINTS = [f"panda_joint{i}" for i in range(1, 8)] + ["panda_gripper"]
HOME = [0.0, -0.5, 0.0, -2.0, 0.0, 1.5, 0.8, 0.5]


def jitter_stats(stamps_s: list[float], rate_hz: float) -> dict:
    periods = np.diff(np.asarray(stamps_s)) * 1e3
    jitter = np.abs(periods - 1e3 / rate_hz)
    return {"ticks": len(periods), **summary(periods, "p50", prefix="period_ms_"),
            **summary(jitter, "p50", "p99", "max", prefix="jitter_ms_")}


# -- 0. the machine's floor ------------------------------------------------------------------------
def sleep_loop(rate_hz: float, seconds: float, out=None) -> dict:
    period = 1.0 / rate_hz
    start = time.monotonic()
    stamps = []
    for i in range(1, int(seconds * rate_hz) + 1):
        target = start + i * period
        while (left := target - time.monotonic()) > 0:
            time.sleep(left)
        stamps.append(time.perf_counter())
    stats = jitter_stats(stamps, rate_hz)
    if out is not None:
        out.put(stats)
    return stats


class Floor:
    """The sleep loop in a process of its own, running beside a measurement."""

    def __init__(self, rate_hz: float, seconds: float):
        ctx = mp.get_context("spawn")
        self.out = ctx.Queue()
        self.process = ctx.Process(target=sleep_loop, args=(rate_hz, seconds, self.out))
        self.process.start()

    def result(self) -> dict:
        stats = self.out.get()
        self.process.join()
        return stats


# -- 1. engine in a thread or a process -----------------------------------------------------------
def _infer_forever(stop, threads: int, nice: int, ready) -> None:
    import torch

    if nice:
        os.nice(nice)
    torch.set_num_threads(threads)
    from ..runtime import EngineConfig, PolicyEngine

    engine = PolicyEngine(EngineConfig.for_mode("eager", preset="tiny", device="cpu"))
    obs = engine.dummy_observation()
    engine.warmup()
    ready.set()
    while not stop.is_set():
        engine.predict(obs)


def _timer_run(where: str, rate_hz: float, seconds: float, threads: int, nice: int, domain: str, out) -> None:
    """A 50 Hz rclpy timer publishing a command, with the engine inferring `where` (in a
    spawned process of its own, so every variant starts from the same state)."""
    ros_environment(domain)
    import rclpy
    from rclpy.clock import Clock, ClockType
    from rclpy.executors import SingleThreadedExecutor
    from std_msgs.msg import Float64MultiArray

    rclpy.init()
    node = rclpy.create_node("jitter_probe")
    pub = node.create_publisher(Float64MultiArray, "probe_command", 10)
    msg = Float64MultiArray(data=list(HOME))
    stamps: list[float] = []

    def tick():
        stamps.append(time.perf_counter())
        pub.publish(msg)

    stop, ready = threading.Event(), threading.Event()
    worker = None
    if where == "thread":
        worker = threading.Thread(target=_infer_forever, args=(stop, threads, 0, ready))
    elif where == "process":
        ctx = mp.get_context("spawn")
        stop, ready = ctx.Event(), ctx.Event()
        worker = ctx.Process(target=_infer_forever, args=(stop, threads, nice, ready))
    if worker is not None:
        worker.start()
        ready.wait(120)
    node.create_timer(1.0 / rate_hz, tick, clock=Clock(clock_type=ClockType.STEADY_TIME))   # as the node's loop
    executor = SingleThreadedExecutor()
    executor.add_node(node)
    out.put("measuring")
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        executor.spin_once(timeout_sec=0.1)
    stop.set()
    if worker is not None:
        worker.join()
    out.put(jitter_stats(stamps[5:], rate_hz))
    rclpy.shutdown()


def where_to_infer(rate_hz: float, seconds: float, threads: int, nice: int, domain: str) -> dict:
    ctx = mp.get_context("spawn")
    results = {}
    for where in ("none", "thread", "process"):
        out = ctx.Queue()
        p = ctx.Process(target=_timer_run, args=(where, rate_hz, seconds, threads, nice, domain, out))
        p.start()
        assert out.get(timeout=180) == "measuring"
        floor = Floor(rate_hz, seconds - 1)
        results[where] = out.get(timeout=seconds + 60)
        p.join()
        results[where]["floor"] = floor.result()
        print(f"  timer + engine in {where:8s}: {_fmt(results[where])}", flush=True)
        print(f"      floor beside it:             {_fmt(results[where]['floor'])}", flush=True)
    return results


# -- 2. the node -------------------------------------------------------------------------------------
class Feeder:
    """Two 640x480 rgb8 cameras and joint states into the node; its commands and diagnostics out.
    `joints(t)`: the joint positions at time.monotonic() t (default: HOME, standing still)."""

    def __init__(self, namespace: str, camera_hz: float, joint_hz: float, height: int, width: int,
                 joints: Optional[Callable[[float], list]] = None):
        import rclpy
        from diagnostic_msgs.msg import DiagnosticArray
        from rclpy.executors import SingleThreadedExecutor
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import Image, JointState
        from std_msgs.msg import Float64MultiArray
        from trajectory_msgs.msg import JointTrajectory

        rclpy.init()
        self.node = rclpy.create_node("node_bench")
        self.target = f"{namespace}/vla_node"
        self.commands: list[float] = []
        self.chunks = 0
        self.diagnostics: dict = {}
        rng = np.random.default_rng(0)
        frames = [rng.integers(0, 256, (height, width, 3), dtype=np.uint8).tobytes() for _ in range(4)]
        self.images = []
        for k in range(len(frames)):
            msg = Image(height=height, width=width, encoding="rgb8", step=width * 3)
            msg.data = frames[k]
            self.images.append(msg)
        # The node's input topics are relative: in its namespace.
        cams = [self.node.create_publisher(Image, f"{namespace}/cameras/{c}/image_raw", qos_profile_sensor_data)
                for c in ("exo", "wrist")]
        joint_pub = self.node.create_publisher(JointState, f"{namespace}/joint_states", qos_profile_sensor_data)
        self.count = 0

        def publish_frames():
            stamp = self.node.get_clock().now().to_msg()
            self.count += 1
            for i, pub in enumerate(cams):
                msg = self.images[(self.count + i) % len(self.images)]
                msg.header.stamp = stamp
                pub.publish(msg)

        def publish_joints():
            msg = JointState(name=JOINTS, position=joints(time.monotonic()) if joints else HOME)
            msg.header.stamp = self.node.get_clock().now().to_msg()
            joint_pub.publish(msg)

        self.node.create_timer(1.0 / camera_hz, publish_frames)
        self.node.create_timer(1.0 / joint_hz, publish_joints)
        self.node.create_subscription(Float64MultiArray, f"{self.target}/command",
                                      lambda _: self.commands.append(time.perf_counter()), 100)
        self.node.create_subscription(JointTrajectory, f"{self.target}/joint_trajectory", self._on_chunk, 10)
        self.node.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        self.executor = SingleThreadedExecutor()
        self.executor.add_node(self.node)
        self.thread = threading.Thread(target=self.executor.spin, daemon=True)
        self.thread.start()

    def _on_chunk(self, _) -> None:
        self.chunks += 1

    def _on_diagnostics(self, msg) -> None:
        for status in msg.status:
            if status.hardware_id == self.target:
                self.diagnostics = {kv.key: kv.value for kv in status.values}
                self.diagnostics["message"] = status.message

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                raise SystemExit(f"node_bench: no {what} within {timeout:.0f} s; last diagnostics: {self.diagnostics}")
            time.sleep(0.05)

    def close(self) -> None:
        import rclpy
        self.executor.shutdown()
        self.node.destroy_node()
        rclpy.shutdown()


def run_node(args, domain: str) -> dict:
    namespace = f"/bench{os.getpid()}"
    command = node_argv(args.params, {"autostart": True, "control_rate_hz": args.rate,
                                      "engine_threads": args.threads, "engine_nice": args.nice},
                        ["-r", f"__ns:={namespace}"])
    log_path = Path(os.environ["ROS_LOG_DIR"]) / f"node_bench_{os.getpid()}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "w")
    node = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ), start_new_session=True)
    feeder = Feeder(namespace, args.camera_hz, args.joint_hz, 480, 640)
    try:
        feeder.wait(lambda: feeder.chunks >= 10, 180, f"chunks from the node (its output: {log_path})")
        # The node's loop statistics cover its last 1000 ticks: measure at least that long.
        seconds = max(args.seconds, 1000 / args.rate + 1)
        start = time.perf_counter()
        received_from = len(feeder.commands)
        chunks_from = feeder.chunks
        floor = Floor(args.rate, seconds)
        time.sleep(seconds)
        received = [t for t in feeder.commands[received_from:] if t >= start]
        d = dict(feeder.diagnostics)
        result = {"seconds": seconds, "chunks": feeder.chunks - chunks_from, "diagnostics": d,
                  "floor": floor.result(),
                  "received": jitter_stats(received, args.rate),
                  "node_loop": {"ticks": min(int(d[Key.TICKS]), 999),
                                "period_ms_p50": float(d[Key.ms(Key.COMMAND_PERIOD, "p50")]),
                                "jitter_ms_p50": float(d[Key.ms(Key.COMMAND_JITTER, "p50")]),
                                "jitter_ms_p99": float(d[Key.ms(Key.COMMAND_JITTER, "p99")]),
                                "jitter_ms_max": float(d[Key.ms(Key.COMMAND_JITTER, "max")])}}
    finally:
        feeder.close()
        interrupt(node, 30)
        log.close()
    return result


def _fmt(s: dict) -> str:
    return (f"period p50 {s['period_ms_p50']:.3f} ms, jitter p50 {s['jitter_ms_p50']:.3f} / "
            f"p99 {s['jitter_ms_p99']:.3f} / max {s['jitter_ms_max']:.3f} ms ({s['ticks']} ticks)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=50.0, help="control rate (Hz)")
    ap.add_argument("--seconds", type=float, default=25.0, help="measurement per run (s)")
    ap.add_argument("--camera-hz", type=float, default=15.0)
    ap.add_argument("--joint-hz", type=float, default=100.0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine")
    ap.add_argument("--nice", type=int, default=10, help="niceness of the engine process")
    ap.add_argument("--params", type=Path, default=CONFIG)
    ap.add_argument("--only", choices=("where", "node"), help="run one part")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)

    domain = ros_domain(os.getpid() ^ time.time_ns())
    ros_environment(domain)
    report = {"machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "load_average_before": os.getloadavg()},
              "args": {k: str(v) for k, v in vars(args).items()}}
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}", flush=True)
    if args.only in (None, "where"):
        report["where"] = where_to_infer(args.rate, args.seconds, args.threads, args.nice, domain)
    if args.only in (None, "node"):
        r = report["node"] = run_node(args, domain)
        d = r["diagnostics"]
        print(f"  node control loop (its own ticks): {_fmt(r['node_loop'])}")
        print(f"  node commands as received here:   {_fmt(r['received'])}")
        print(f"      floor beside it:             {_fmt(r['floor'])}")
        def p(name: str, q: str):
            return d.get(Key.ms(name, q))

        print(f"  chunks: {r['chunks']} in {r['seconds']:.0f} s; engine total p50 "
              f"{p(Key.engine_stage('total'), 'p50')} ms, predict() p50 {p(Key.ENGINE_PREDICT, 'p50')} / p99 "
              f"{p(Key.ENGINE_PREDICT, 'p99')} ms")
        print(f"  node overhead per observation: p50 {p(Key.NODE_OVERHEAD, 'p50')} / p99 "
              f"{p(Key.NODE_OVERHEAD, 'p99')} ms; frame ingest (copy into shared memory) per frame: p50 "
              f"{p(Key.FRAME_INGEST, 'p50')} / p99 {p(Key.FRAME_INGEST, 'p99')} ms")
        print("      parts (p50 / p99 ms): " + ", ".join(
            f"{part} {p(Key.overhead_part(part), 'p50')} / {p(Key.overhead_part(part), 'p99')}"
            for part in OVERHEAD_PARTS))
        print(f"      then ~/joint_trajectory built and published: p50 {p(Key.TRAJECTORY_PUBLISH, 'p50')} / "
              f"p99 {p(Key.TRAJECTORY_PUBLISH, 'p99')} ms")
    report["machine"]["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0



if __name__ == "__main__":
    sys.exit(main())
