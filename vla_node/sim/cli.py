"""vla-sim: gym-aloha transfer-cube for vla_node.

    vla-sim run --episodes 5                 # the simulator as a ROS 2 node (cameras, /joint_states,
                                             # /clock), closed loop with vla-node (use_sim_time)
    vla-sim run --episodes 5 --lockstep      # the same, every tick waiting for the node's command: with
                                             # its fixed_latency_s the same run on any machine
    vla-sim eval --configs eager,fast --episodes 50 --json out/sim_eval.json
                                             # the same loop without DDS: the engine called directly,
                                             # the shipped policy (or --checkpoint DIR, --random-weights)
    vla-sim record out/demos --episodes 50   # scripted demonstrations, one MCAP bag each (all cores)
    vla-sim expert --episodes 50             # the scripted expert's own success rate

Only `run` needs ROS (rclpy); `eval` needs torch; `record` and `expert` need neither.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Optional

from . import SIM_POLICY
from .aloha import DEFAULT_CAMERAS, RenderConfig

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PARAMS = ROOT / "config" / "sim.yaml"
RANDOM_PRESET = "sim"    # eval --random-weights: the preset with the simulator's 14 joints
MAX_SEEDS_PER_EPISODE = 5  # record gives up when the script fails this often (it succeeds on ~all seeds)


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def _workers(n: int) -> int:
    return n or len(os.sched_getaffinity(0))


# -- expert -----------------------------------------------------------------------------------
def _expert_seed(seed: int) -> dict:
    from .aloha import TransferCube
    from .expert import expert_episode
    with TransferCube() as env:
        episode = expert_episode(env, seed)
    return {"seed": seed, "success": bool(episode.success), "first_success_tick": episode.first_success_tick,
            "max_reward": max(s.reward for s in episode.states)}


def run_expert(args) -> int:
    from .closed_loop import wilson_interval
    seeds = list(range(args.first_seed, args.first_seed + args.episodes))
    t0 = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(_workers(args.workers)) as pool:
        episodes = pool.map(_expert_seed, seeds)
    wins = sum(e["success"] for e in episodes)
    low, high = wilson_interval(wins, len(episodes))
    print(f"scripted expert: {wins}/{len(episodes)} seeds {seeds[0]}..{seeds[-1]} succeed "
          f"({100 * wins / len(episodes):.0f} %, 95 % interval {100 * low:.0f}-{100 * high:.0f} %), "
          f"{time.perf_counter() - t0:.1f} s")
    failed = [e["seed"] for e in episodes if not e["success"]]
    if failed:
        print(f"  failed seeds: {failed}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"successes": wins, "episodes": episodes,
                                               "success_ci95": [low, high]}, indent=2) + "\n")
    return 0


# -- record -----------------------------------------------------------------------------------
def _record_seed(job: tuple) -> dict:
    from dataclasses import asdict

    from .aloha import TransferCube
    from .record import record_episode
    seed, out_dir, config = job
    with TransferCube(config.render) as env:
        return asdict(record_episode(env, seed, Path(out_dir) / f"episode_{seed:05d}.mcap", config))


def run_record(args) -> int:
    from .record import EpisodeRecord, RecordConfig, write_manifest
    config = RecordConfig(render=_render_config(args), camera_every=args.camera_every,
                          jpeg_quality=None if args.raw else args.jpeg_quality, ticks=args.ticks,
                          reference_horizon=args.reference_horizon)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kept: list[EpisodeRecord] = []
    next_seed, t0 = args.first_seed, time.perf_counter()
    workers = _workers(args.workers)
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        # Failed episodes are deleted and replaced by the next seeds: the set is the first
        # `episodes` seeds (from first_seed) on which the script succeeds, however many workers.
        while len(kept) < args.episodes:
            if next_seed - args.first_seed >= MAX_SEEDS_PER_EPISODE * args.episodes:
                print(f"vla-sim record: the script succeeded on {len(kept)} of {next_seed - args.first_seed} seeds; "
                      f"stopping (too short --ticks? the script succeeds around tick 300; or --keep-failures)")
                return 1
            batch = list(range(next_seed, next_seed + max(workers, args.episodes - len(kept))))
            next_seed = batch[-1] + 1
            for record in pool.imap(_record_seed, [(s, str(out), config) for s in batch]):
                record = EpisodeRecord(**record)
                if (record.success or args.keep_failures) and len(kept) < args.episodes:
                    kept.append(record)
                else:
                    Path(record.path).unlink()
                print(f"seed {record.seed}: {'success' if record.success else 'FAILED'}, "
                      f"{record.bytes / 1e6:.2f} MB", flush=True)
    write_manifest(kept, out / "episodes.json", config)
    total = sum(r.bytes for r in kept)
    wins = sum(r.success for r in kept)
    print(f"wrote {len(kept)} episodes ({wins} successful) to {out}: {total / 1e6:.1f} MB "
          f"({total / 1e6 / max(1, len(kept)):.2f} MB each), {time.perf_counter() - t0:.0f} s with {workers} workers")
    return 0


# -- eval -------------------------------------------------------------------------------------
def run_eval(args) -> int:
    from .eval import evaluate, table
    args.workers = _workers(args.workers)
    args.checkpoint, args.preset = _eval_policy(args)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    report = evaluate(args, save=lambda report: Path(args.json).write_text(json.dumps(report, indent=2) + "\n"))
    print(f"\n{table(report)}\nreport: {args.json}")
    return 0


def _eval_policy(args) -> tuple[Optional[str], str]:
    """The (checkpoint, preset) eval runs: the shipped policy, the one --checkpoint names, or
    random weights of --preset when --random-weights asks for them (and only then)."""
    if args.random_weights:
        if args.checkpoint:
            raise ValueError("--random-weights and --checkpoint exclude each other")
        return None, args.preset or RANDOM_PRESET
    if args.preset:
        raise ValueError(f"--preset {args.preset} picks the model of --random-weights (a checkpoint brings its own); "
                         "add --random-weights for random weights")
    return args.checkpoint or str(SIM_POLICY), RANDOM_PRESET


def _render_config(args) -> RenderConfig:
    return RenderConfig(cameras=tuple(args.cameras), height=args.height, width=args.width, shadows=args.shadows)


def _add_render_arguments(parser: argparse.ArgumentParser, defaults_from_params: bool = False) -> None:
    group = parser.add_argument_group("cameras")
    note = " (default: the params file's)" if defaults_from_params else ""
    group.add_argument("--cameras", type=_csv, default=None if defaults_from_params else list(DEFAULT_CAMERAS),
                       help=f"cameras of the model to render, by name{note or ' (default %(default)s)'}")
    group.add_argument("--height", type=int, default=None if defaults_from_params else RenderConfig.height,
                       help=f"image height{note or ' (default %(default)s)'}")
    group.add_argument("--width", type=int, default=None if defaults_from_params else RenderConfig.width,
                       help=f"image width{note or ' (default %(default)s)'}")
    group.add_argument("--shadows", action="store_true",
                       help="gym-aloha's look: shadow maps and multisampling (~8x slower on a CPU)")


def build_parser() -> argparse.ArgumentParser:
    from .expert import EPISODE_TICKS
    parser = argparse.ArgumentParser(prog="vla-sim", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    expert = sub.add_parser("expert", help="the scripted expert's success rate (no rendering)")
    expert.add_argument("--episodes", type=int, default=50)
    expert.add_argument("--first-seed", type=int, default=0)
    expert.add_argument("--workers", type=int, default=0, help="processes (default: every core)")
    expert.add_argument("--json", default=None)

    record = sub.add_parser("record", help="scripted demonstrations, one MCAP bag per episode")
    record.add_argument("out", help="folder for episode_SEED.mcap and episodes.json")
    record.add_argument("--episodes", type=int, default=50, help="successful episodes to keep (default %(default)s)")
    record.add_argument("--first-seed", type=int, default=0)
    record.add_argument("--workers", type=int, default=0, help="processes (default: every core)")
    record.add_argument("--ticks", type=int, default=EPISODE_TICKS, help="control ticks of 20 ms per episode")
    record.add_argument("--camera-every", type=int, default=1, help="a camera frame every N ticks (1: 50 Hz)")
    record.add_argument("--jpeg-quality", type=int, default=85)
    record.add_argument("--raw", action="store_true", help="raw rgb8 Image instead of JPEG CompressedImage")
    record.add_argument("--reference-horizon", type=int, default=0,
                        help="also write the next N expert commands per frame on /reference/joint_trajectory")
    record.add_argument("--keep-failures", action="store_true", help="keep episodes the script failed")
    _add_render_arguments(record)

    ev = sub.add_parser("eval", help="closed loop without DDS: the engine called directly, the node's hand-over")
    ev.add_argument("--episodes", type=int, default=50)
    ev.add_argument("--first-seed", type=int, default=1000, help="seeds first_seed.. (demos use 0..: held out)")
    ev.add_argument("--configs", default="eager",
                    help="comma-separated MODE[:KEY=VALUE...] engine configurations (as vla-replay offline)")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                    help="an EngineConfig field for every configuration (repeatable)")
    ev.add_argument("--checkpoint", default=None,
                    help=f"policy checkpoint folder (default: the shipped policy, {SIM_POLICY.relative_to(ROOT)})")
    ev.add_argument("--random-weights", action="store_true",
                    help="random weights of --preset instead of a checkpoint: the loop runs, the policy does nothing "
                         "useful")
    ev.add_argument("--preset", default=None,
                    help=f"--random-weights: the model preset (default {RANDOM_PRESET}: the shipped policy's shapes)")
    ev.add_argument("--device", default="cpu")
    ev.add_argument("--dtype", default="float32")
    ev.add_argument("--seed", type=int, default=0, help="engine seed (random weights, flow noise)")
    ev.add_argument("--params", default=str(DEFAULT_PARAMS),
                    help="vla_node params file for cameras, hand-over, limits (default: config/sim.yaml)")
    ev.add_argument("--handover", type=_csv, default=None, help="hand-over modes to compare, e.g. rtc,average "
                                                                "(default: the params file's)")
    ev.add_argument("--latency-ms", type=_csv, default=["measured"],
                    help="inference latency in sim time: 'measured' (each query's predict time), 'alone' (the "
                         "median predict time of one episode run first by one process alone, then fixed: with "
                         "--workers sharing a GPU) or ms, comma-separated to compare (default %(default)s)")
    ev.add_argument("--ticks", type=int, default=EPISODE_TICKS, help="episode length in 20 ms ticks")
    ev.add_argument("--camera-every", type=int, default=1)
    ev.add_argument("--video-dir", default=None, help="write a video of the first --videos episodes per config")
    ev.add_argument("--videos", type=int, default=1)
    ev.add_argument("--workers", type=int, default=1,
                    help="processes sharing each configuration's seeds (0: every core)")
    ev.add_argument("--json", default="out/sim_eval.json")
    _add_render_arguments(ev, defaults_from_params=True)

    _add_run_parser(sub, EPISODE_TICKS)
    return parser


def _add_run_parser(sub, episode_ticks: int) -> None:
    run = sub.add_parser("run", help="the simulator as a ROS 2 node (needs rclpy); ROS arguments after --ros-args")
    run.add_argument("--episodes", type=int, default=1)
    run.add_argument("--first-seed", type=int, default=1000)
    run.add_argument("--ticks", type=int, default=episode_ticks, help="episode length in 20 ms ticks")
    run.add_argument("--run-on", action="store_true", help="finish every episode's ticks after a success")
    run.add_argument("--camera-every", type=int, default=1)
    run.add_argument("--rate", type=float, default=1.0, help="sim time per wall time, at most (default %(default)s)")
    run.add_argument("--command-topic", default="vla_node/command", help="the node's ~/command (default %(default)s)")
    run.add_argument("--command-timeout-s", type=float, default=1.0,
                     help="wall time to wait for a tick's command before holding the last one")
    run.add_argument("--lockstep", action="store_true",
                     help="every tick waits for the node's command stamped with its time (its ~/joint_command: "
                          "publish_joint_command:=true), however long it takes, without pacing against the wall "
                          "clock; with the node's fixed_latency_s the closed loop is the same on any machine")
    run.add_argument("--joint-command-topic", default="vla_node/joint_command",
                     help="--lockstep: the node's ~/joint_command (default %(default)s)")
    run.add_argument("--lockstep-timeout-s", type=float, default=120.0,
                     help="--lockstep: wall time a tick waits for its command before the run ends with an error "
                          "(default %(default)s)")
    run.add_argument("--node-timeout-s", type=float, default=600.0,
                     help="wall time to wait for the node's first command (it loads and warms up its model)")
    run.add_argument("--params", default=str(DEFAULT_PARAMS),
                     help="the node's params file: cameras, image size, limits, instruction (default: config/sim.yaml)")
    run.add_argument("--video-dir", default=None, help="write a video per episode here")
    run.add_argument("--json", default=None, help="write the episodes' results here")
    _add_render_arguments(run, defaults_from_params=True)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ros_args = argv[argv.index("--ros-args"):] if "--ros-args" in argv else []
    args = build_parser().parse_args(argv[:len(argv) - len(ros_args)])
    try:
        if args.command == "run":
            from .node import run
            return run(args, ros_args)
        with _sigterm_exits():
            return {"expert": run_expert, "record": run_record, "eval": run_eval}[args.command](args)
    except (ValueError, OSError) as err:
        print(f"vla-sim {args.command}: {err}", file=sys.stderr)
        return 1


@contextmanager
def _sigterm_exits():
    """SIGTERM (kill, timeout) raises SystemExit, so the commands' `with Pool` blocks terminate their
    worker processes on the way out: killed outright, the parent would leave them running."""
    def _exit(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _exit)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
