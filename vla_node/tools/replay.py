"""vla-replay: evaluate a policy on recorded rosbag2 bags (sqlite3 or mcap).

    vla-replay offline BAG --configs eager,fast            # engine only, frame for frame, same noise
    vla-replay offline BAG --configs eager,fast:flow_steps=5 --set device=cuda --set dtype=bfloat16
    vla-replay live BAG --rate 0.5                         # into a running vla_node; records its outputs

offline needs no ROS; live needs rclpy and a running node (vla-node --ros-args -p autostart:=true).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Optional

from ..runtime import LAYOUTS, MODES
from ..runtime.windows import MAX_CAMERA_RATE_HZ, STATE_SLOP_S, SYNC_SLOP_S
from .bag_io import CAMERA_TOPICS, INSTRUCTION_TOPIC, JOINT_NAMES, JOINT_STATES_TOPIC, REFERENCE_TOPIC, BagError


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def add_topic_arguments(parser: argparse.ArgumentParser, live: bool) -> None:
    """The bag's topics. Offline defaults to the node's default topic names; live to the running
    node's own topic names (read from its parameters)."""
    topics = parser.add_argument_group("the bag's topics")
    node = "the node's" if live else None
    topics.add_argument("--camera-topics", type=_csv, default=None if live else list(CAMERA_TOPICS),
                        help="camera topics in the layout's camera order; TOPIC/compressed matches too "
                             f"(default: {node or list(CAMERA_TOPICS)})")
    topics.add_argument("--joint-states", default=None if live else JOINT_STATES_TOPIC,
                        help=f"(default: {node or JOINT_STATES_TOPIC})")
    topics.add_argument("--instruction-topic", default=None if live else INSTRUCTION_TOPIC,
                        help=f"(default: {node or INSTRUCTION_TOPIC})")
    topics.add_argument("--instruction", default=None,
                        help="instruction text, instead of the bag's instruction topic")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vla-replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    off = sub.add_parser("offline", help="feed the bag's observations straight through the engine (no DDS)")
    off.add_argument("bag", type=Path)
    off.add_argument("--configs", default="eager",
                     help=f"comma-separated MODE[:KEY=VALUE...]; modes {list(MODES)}; the first is the baseline "
                          "whose noise every other configuration uses (default %(default)s)")
    off.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="an EngineConfig field for every configuration (repeatable)")
    off.add_argument("--preset", default="tiny")
    off.add_argument("--checkpoint", default=None)
    off.add_argument("--device", default="cpu")
    off.add_argument("--layout", default="droid", choices=sorted(LAYOUTS))
    off.add_argument("--seed", type=int, default=0)
    off.add_argument("--reference-topic", default=REFERENCE_TOPIC,
                     help="JointTrajectory reference actions, matched to queries by stamp (used when present)")
    off.add_argument("--every", type=int, default=1, help="evaluate every Nth query")
    off.add_argument("--max-frames", type=int, default=None, help="stop after this many queries")
    off.add_argument("--sync-slop", type=float, default=SYNC_SLOP_S,
                     help="largest stamp difference between cameras in one query, s (the node's sync_slop_s)")
    off.add_argument("--state-slop", type=float, default=STATE_SLOP_S,
                     help="largest stamp difference between a query's newest frame and each joint's sample, s "
                          "(the node's state_slop_s)")
    off.add_argument("--history-offset", type=float, default=0.0,
                     help="seconds between a query's frame times; 0: the checkpoint's (the node's history_offset_s)")
    off.add_argument("--wait-for-history", action="store_true",
                     help="no query until every history frame exists (the node's wait_for_history); by default "
                          "early queries hold the newest frame times only, as the policy's own wrapper does")
    off.add_argument("--state-sync", choices=("frame", "newest"), default="frame",
                     help="the state of a query: each joint's sample nearest its newest frame, or the newest sample "
                          "of each joint (the node's state_sync)")
    off.add_argument("--max-camera-rate", type=float, default=MAX_CAMERA_RATE_HZ,
                     help="camera rate the history buffer is sized for, Hz (the node's max_camera_rate_hz)")
    off.add_argument("--out", type=Path, default=Path("out/replay_offline"), help="report.json and plots go here")
    off.add_argument("--joint-names", type=_csv, default=list(JOINT_NAMES),
                     help="joints that make the model's state, in order; joint states are reordered to them by "
                          "name, from one message or several (default: the node's joint_names, a Panda)")
    add_topic_arguments(off, live=False)

    live = sub.add_parser("live", help="publish the bag into a running node and record what it publishes")
    live.add_argument("bag", type=Path)
    live.add_argument("--rate", type=float, default=1.0, help="playback speed factor (default %(default)s)")
    live.add_argument("--clock", choices=("auto", "on", "off"), default="auto",
                      help="publish /clock from the bag's time: auto = when the node has use_sim_time; without "
                           "it header stamps are shifted to the wall-clock time of playback (default %(default)s)")
    live.add_argument("--clock-hz", type=float, default=0.0,
                      help="/clock rate (default: 4x the node's control rate, at least 100 Hz)")
    live.add_argument("--node", default="/vla_node", help="the node under test (default %(default)s)")
    live.add_argument("--out", type=Path, default=Path("out/replay_live"),
                      help="the recording (a new bag), summary.json and plots go here (default %(default)s)")
    live.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap", help="of the recording")
    live.add_argument("--wait", type=float, default=60.0,
                      help="seconds to wait for the node, its topics and subscriptions (default %(default)s)")
    live.add_argument("--tail", type=float, default=1.0,
                      help="seconds to keep recording after the last message (default %(default)s)")
    add_topic_arguments(live, live=True)

    return parser


def run_offline(args) -> int:
    from .offline import BagQuery, evaluate, parse_configs, parse_overrides, print_summary

    specs = parse_configs(args.configs)
    common = {"preset": args.preset, "checkpoint": args.checkpoint, "device": args.device,
              "layout": LAYOUTS[args.layout], "seed": args.seed, **parse_overrides(args.overrides)}
    query = BagQuery(bag=args.bag, camera_topics=args.camera_topics, joint_states=args.joint_states,
                     instruction_topic=None if args.instruction else args.instruction_topic,
                     instruction=args.instruction, reference_topic=args.reference_topic,
                     joint_names=args.joint_names, every=args.every, max_frames=args.max_frames,
                     sync_slop_s=args.sync_slop, state_slop_s=args.state_slop, history_offset_s=args.history_offset,
                     wait_for_history=args.wait_for_history, max_camera_rate_hz=args.max_camera_rate,
                     state_sync=args.state_sync)
    report = evaluate(query, specs, common, args.out, progress=lambda m: print(m, flush=True))
    print()
    print_summary(report)
    return 0


def run_live(args) -> int:
    from .live import LiveError, LiveOptions, print_summary, replay_live
    from .node_process import frame_transport

    if "FASTDDS_DEFAULT_PROFILES_FILE" not in os.environ and "FASTDDS_BUILTIN_TRANSPORTS" not in os.environ:
        frame_transport()   # this process writes the frames: its shared memory must hold them
    options = LiveOptions(bag=args.bag, rate=args.rate, clock=args.clock, clock_hz=args.clock_hz, node=args.node,
                          out=args.out, storage=args.storage, wait_s=args.wait, tail_s=args.tail,
                          camera_topics=args.camera_topics, joint_states=args.joint_states,
                          instruction_topic=args.instruction_topic, instruction=args.instruction)
    try:
        summary = replay_live(options, progress=lambda m: print(m, flush=True))
    except LiveError as err:
        print(f"vla-replay: error: {err}", file=sys.stderr)
        return 2
    print()
    print_summary(summary)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_offline(args) if args.command == "offline" else run_live(args)
    except (BagError, ValueError) as err:
        print(f"vla-replay: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
