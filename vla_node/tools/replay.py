"""vla-replay: evaluate a policy on recorded rosbag2 bags (sqlite3 or mcap).

    vla-replay offline BAG --configs eager,fast            # engine only, frame for frame, same noise
    vla-replay offline BAG --configs eager,fast:flow_steps=5 --set device=cuda --set dtype=bfloat16

offline needs no ROS.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

from ..runtime import LAYOUTS, MODES
from .bag_io import CAMERA_TOPICS, INSTRUCTION_TOPIC, JOINT_STATES_TOPIC, REFERENCE_TOPIC, SYNC_SLOP_S, BagError


def _csv(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def add_topic_arguments(parser: argparse.ArgumentParser) -> None:
    topics = parser.add_argument_group("topics")
    topics.add_argument("--camera-topics", type=_csv, default=list(CAMERA_TOPICS),
                        help="the node's camera topics in layout order; a bag may hold TOPIC/compressed instead "
                             "(default %(default)s)")
    topics.add_argument("--joint-states", default=JOINT_STATES_TOPIC)
    topics.add_argument("--instruction-topic", default=INSTRUCTION_TOPIC)
    topics.add_argument("--instruction", default=None,
                        help="instruction text, for bags without an instruction topic (replaces the topic)")
    topics.add_argument("--joint-names", type=_csv, default=None,
                        help="joint state entries that make the model's state, in order (default: all, as recorded)")


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
    off.add_argument("--every", type=int, default=1, help="query every Nth frame of the first camera")
    off.add_argument("--max-frames", type=int, default=None, help="stop after this many queries")
    off.add_argument("--sync-slop", type=float, default=SYNC_SLOP_S,
                     help="largest stamp difference between cameras in one query, s (the node's sync_slop_s)")
    off.add_argument("--out", type=Path, default=Path("out/replay_offline"), help="report.json and plots go here")
    add_topic_arguments(off)

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
                     sync_slop_s=args.sync_slop)
    report = evaluate(query, specs, common, args.out, progress=lambda m: print(m, flush=True))
    print()
    print_summary(report)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_offline(args)
    except (BagError, ValueError) as err:
        print(f"vla-replay: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
