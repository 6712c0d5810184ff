"""vla-demo (`make demo`): a trained policy closing the loop over ROS 2 on the CPU, then the
tiny policy fed the bags shipped with the package.

  1. closed loop: `vla-sim run --lockstep` (gym-aloha transfer-cube: cameras, joint states,
     /clock) and `vla-node` with the shipped policy (vla_node/data/sim_policy, trained with
     vla-train on scripted demonstrations), in sim time, one episode with inference counted as
     the 40 ms it was evaluated with (fixed_latency_s; the same run on any machine): success,
     command period, query latency, and a video of the camera with the commanded joints;
  2. starts `vla-node --ros-args --params-file config/tiny.yaml -p autostart:=true`, replays
     vla_node/data/sample_droid.mcap into it in recorded timing, records everything it
     publishes, and prints chunks, command rate and jitter, latency per stage and holds;
  3. replays the same bag offline through two engine configurations on the same noise: how
     far their actions are apart, and how fast each is; then vla_node/data/sample_quirks.mcap,
     the same scene as real robots record it (30 Hz jpeg + bgr8 cameras with jitter, a camera
     dropout, arm and gripper in separate shuffled joint states, an instruction change, stamps
     stepping back), through the first configuration: what became of each frame.

Plots, the recording, the video and JSON summaries go to out/demo/. The demo keeps to a ROS
domain of its own: ROS_DOMAIN_ID if set, else a random one.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..ros.diagnostics import Key
from ..sim import SIM_POLICY
from .live import LiveOptions, print_summary, replay_live
from .node_process import interrupt, node_argv, ros_environment
from .sample_bag import QUIRKS_BAG, SAMPLE_BAG

SIM_SEED = 1000  # the first held-out seed (the demonstrations used seeds 0-99)
SIM_LATENCY_S = 0.04  # the inference latency the shipped policy was evaluated with (its README)

Print = Callable[[str], None]
NODE = "/vla_node"
OFFLINE_CONFIGS = "eager,fused"


def config_file(name: str) -> Path:
    """config/<name> of the source tree, else the copy installed under share/vla_node."""
    for path in (Path(__file__).resolve().parents[2] / "config" / name,
                 Path(sys.prefix) / "share" / "vla_node" / "config" / name):
        if path.exists():
            return path
    raise FileNotFoundError(f"config/{name} not found in the source tree or under share/vla_node")


class NodeProcess:
    """`vla-node` as a child process (its own session, so Ctrl-C of the demo reaches it only
    through stop()), its output in a log file."""

    def __init__(self, params_file: Path, log_path: Path, overrides: Optional[dict] = None, ros_args: tuple = ()):
        self.command = node_argv(params_file, {"autostart": True, **(overrides or {})}, ros_args)
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)

    def exited(self) -> Optional[str]:
        """Why the node is gone, or None while it runs."""
        code = self.proc.poll()
        return None if code is None else f"vla-node exited with code {code}; its log: {self.log_path}"

    def log_tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout_s: float = 20.0) -> Optional[int]:
        """Ctrl-C, as a user would: the node ends its engine process and exits."""
        code = interrupt(self.proc, timeout_s)
        self._log.close()
        return code

    def __enter__(self) -> "NodeProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def closed_loop(out: Path, print_fn: Print, episodes: int = 1) -> dict:
    """The shipped policy in the simulator, over ROS 2 in sim time (vla-sim run + vla-node), in
    lockstep with a fixed inference latency: the same episodes on any machine."""
    report = out / "sim.json"
    overrides = {"use_sim_time": True, "checkpoint": str(SIM_POLICY), "engine_mode": "fused",
                 "fixed_latency_s": SIM_LATENCY_S}
    with NodeProcess(config_file("sim.yaml"), out / "sim_node.log", overrides) as node:
        sim = subprocess.run([sys.executable, "-m", "vla_node.sim", "run", "--lockstep", "--episodes", str(episodes),
                              "--first-seed", str(SIM_SEED), "--json", str(report), "--video-dir", str(out)],
                             capture_output=True, text=True, timeout=900)
        if sim.returncode != 0 or not report.exists():
            raise RuntimeError(f"vla-sim run failed: {(sim.stderr or sim.stdout).strip().splitlines()[-1:]}; "
                               f"the node's last log lines:\n{node.log_tail()}")
    result = json.loads(report.read_text())
    for ep in result["per_episode"]:
        sim_s = ep["ticks"] * 0.02
        print_fn(f"      seed {ep['seed']}: {'SUCCESS' if ep['success'] else 'no success'} "
                 f"(reward {ep['max_reward']}/4) "
                 f"after {ep['ticks']} ticks = {sim_s:.1f} s sim time in {ep['wall_s']:.0f} s wall; "
                 f"{ep['commands']} node commands at 50 Hz sim time, in lockstep")
        node = ep.get("node_report", {})
        if node:
            def p(name: str, q: str) -> str:
                return node.get(Key.ms(name, q), "?")

            print_fn(f"      node: a tick every {p(Key.COMMAND_PERIOD, 'p50')} ms of wall time (p50: lockstep runs as "
                     f"fast as the machine can), inference {p(Key.ENGINE_PREDICT, 'p50')} / "
                     f"{p(Key.ENGINE_PREDICT, 'p99')} ms (p50 / p99 wall time), each chunk taken "
                     f"{SIM_LATENCY_S * 1e3:.0f} ms of sim time after its request (fixed_latency_s)")
        if ep.get("video"):
            print_fn(f"      video: {ep['video']}")
    return result


def tiny_config() -> Path:
    return config_file("tiny.yaml")


@dataclass
class DemoResult:
    closed_loop: Optional[dict]
    live: dict
    offline: Optional[dict]
    quirks: Optional[dict]      # the quirky bag offline
    seconds: float


def run_demo(out: Path, offline_configs: Optional[str] = OFFLINE_CONFIGS, print_fn: Print = print,
             sim_episodes: int = 1) -> DemoResult:
    t0 = time.monotonic()
    domain = ros_environment()
    if out.exists():
        shutil.rmtree(out)   # the demo's own output folder: each run starts clean
    out.mkdir(parents=True)
    print_fn(f"vla-demo: VLA policies as a ROS 2 node on the CPU (ROS domain {domain})")
    loop = None
    if sim_episodes:
        print_fn(f"[1/3] closed loop: vla-sim (gym-aloha transfer-cube) <-> vla-node with the trained policy "
                 f"{SIM_POLICY.name}, sim time in lockstep, {sim_episodes} episode(s)")
        loop = closed_loop(out, print_fn, sim_episodes)
        print_fn("")
    params_file = config_file("tiny.yaml")
    print_fn(f"[2/3] vla-node with {params_file} (log: {out / 'node.log'}): live replay of {SAMPLE_BAG.name}")
    with NodeProcess(params_file, out / "node.log") as node:
        try:
            live = replay_live(LiveOptions(bag=SAMPLE_BAG, node=NODE, out=out / "live", wait_s=180.0,
                                           abort_if=node.exited),
                               progress=lambda m: print_fn(f"      {m}"))
        except BaseException:
            print_fn(f"      the node's last log lines:\n{node.log_tail()}")
            raise
    print_fn("")
    print_summary(live, print_fn)
    offline = quirks = None
    if offline_configs:
        # Imported here: torch's import would compete with the node's start-up for the CPU.
        from ..runtime import LAYOUTS
        from .bag_io import CAMERA_TOPICS, INSTRUCTION_TOPIC, JOINT_STATES_TOPIC, REFERENCE_TOPIC
        from .offline import BagQuery, evaluate, parse_configs
        from .offline import print_summary as print_offline
        print_fn("")
        print_fn(f"[3/3] offline replay of {SAMPLE_BAG.name} through {offline_configs} (same frames, same noise)")
        common = {"preset": "tiny", "device": "cpu", "layout": LAYOUTS["droid"]}
        query = BagQuery(SAMPLE_BAG, CAMERA_TOPICS, JOINT_STATES_TOPIC, INSTRUCTION_TOPIC, None, REFERENCE_TOPIC)
        offline = evaluate(query, parse_configs(offline_configs), common, out / "offline", progress=lambda m: None)
        print_offline(offline, print_fn)
        first = parse_configs(offline_configs)[:1]
        print_fn("")
        print_fn(f"      offline replay of {QUIRKS_BAG.name} through {first[0].label}: real-world input")
        query = BagQuery(QUIRKS_BAG, CAMERA_TOPICS, JOINT_STATES_TOPIC, INSTRUCTION_TOPIC, None, REFERENCE_TOPIC)
        quirks = evaluate(query, first, common, out / "quirks", progress=lambda m: None)
        print_offline(quirks, print_fn)
    seconds = time.monotonic() - t0
    print_fn("")
    print_fn(f"done in {seconds:.0f} s. Plots: {out / 'live'} (commands.png, timing.png), "
             f"{out / 'offline'} (actions_*.png, latency.png)" if offline else f"done in {seconds:.0f} s.")
    return DemoResult(loop, live, offline, quirks, seconds)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="vla-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("out/demo"), help="output folder (default %(default)s)")
    parser.add_argument("--offline-configs", default=OFFLINE_CONFIGS,
                        help="engine configurations compared offline; empty: skip (default %(default)s)")
    parser.add_argument("--sim-episodes", type=int, default=1, help="closed-loop episodes (0: skip)")
    args = parser.parse_args(argv)
    try:
        run_demo(args.out, args.offline_configs or None, print_fn=lambda m: print(m, flush=True),
                 sim_episodes=args.sim_episodes)
    except KeyboardInterrupt:
        print("vla-demo: interrupted", file=sys.stderr)
        return 130
    except Exception as err:   # a demo ends with a sentence, not a traceback
        print(f"vla-demo: failed: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
