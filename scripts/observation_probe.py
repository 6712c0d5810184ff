"""Replay a bag that vla_node's own bag writer did not write into `vla-replay offline`'s reader and
into a live node, and check every observation against what was recorded.

    python scripts/observation_probe.py --variant mixed --out out/probe     # offline and live
    python scripts/observation_probe.py --variant behind --offline-only

The bag is written with `rosbags` alone. Its quirks differ from the shipped sample_quirks.mcap:
- raw `yuv422_yuy2` exterior frames at 60 Hz (twice the buffer's max_camera_rate_hz) and raw
  `bayer_rggb8` wrist frames at 25 Hz, 7 ms late;
- the arm at 200 Hz with the finger joints shuffled in, and the gripper in its own message;
- every stamp stepping back 1 s at 3.0 s, and an instruction change at 2.0 s.

Variants: `mixed` (the gripper also silent from 5.0 to 5.6 s), `behind` (the wrist camera stamped on
a clock 2 s behind), `unstamped` (the wrist camera's stamps are all 0), `slow-gripper` (the gripper
at 10 Hz).

Checks, for each observation: its frames and joint samples all come from one side of the step
back; its state is the values written, by joint name; the history frame is offset_s back, within
one exterior frame period. Live replay must send the same frames and state as offline replay for
every query both make. The live replay's holds are printed in order.
"""
import argparse
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
from rosbags.rosbag2 import Writer
from rosbags.typesys import Stores, get_typestore

from vla_node.runtime import LAYOUTS
from vla_node.runtime.windows import PANDA_JOINTS
from vla_node.tools.bag_io import Bag, ObservationStream, resolve_inputs
from vla_node.tools.demo import NodeProcess, tiny_config
from vla_node.tools.live import LiveOptions, logged_observations, replay_live

TYPES = get_typestore(Stores.ROS2_HUMBLE)
START_NS = 1_700_000_000 * 10**9
STEP_AT_S, STEP_BACK_S = 3.0, 1.0
DURATION_S, HEIGHT, WIDTH = 8.0, 120, 160
OFFSET_S = 8 / 15                # the tiny checkpoint's history offset (MolmoBot-DROID's)
EXO_HZ = 60.0


def write_bag(path: Path, variant: str) -> dict:
    """Write the bag; returns (source, stamp) -> (recorded time s, value) for every frame and joint sample."""
    rng = np.random.default_rng(7)
    gripper_hz = 10.0 if variant == "slow-gripper" else 20.0
    events = []   # (log time s, kind, time s)
    events += [(t + 0.004, "exo", t) for t in (i / EXO_HZ + rng.uniform(-0.002, 0.002)
                                               for i in range(int(DURATION_S * EXO_HZ)))]
    events += [(t + 0.006, "wrist", t) for t in (i / 25 + 0.007 + rng.uniform(-0.002, 0.002)
                                                 for i in range(int(DURATION_S * 25)))]
    # Joint stamps get jitter too: after the step back no two samples of a joint share a stamp.
    events += [(t + 0.001, "arm", t) for t in (i / 200 + rng.uniform(-2e-4, 2e-4)
                                               for i in range(int(DURATION_S * 200)))]
    events += [(t + 0.001, "gripper", t) for t in (i / gripper_hz + 0.005 + rng.uniform(-2e-4, 2e-4)
                                                   for i in range(int(DURATION_S * gripper_hz)))
               if not (variant == "mixed" and 5.0 <= t < 5.6)]
    events += [(0.0, "instruction", "pick up the red block"), (2.0, "instruction", "put it in the bowl")]
    events.sort(key=lambda e: e[0])
    Image, JointState, String = (TYPES.types[f"{p}/msg/{n}"] for p, n in
                                 (("sensor_msgs", "Image"), ("sensor_msgs", "JointState"), ("std_msgs", "String")))
    Header, Time = TYPES.types["std_msgs/msg/Header"], TYPES.types["builtin_interfaces/msg/Time"]
    arm_names = [f"panda_joint{i}" for i in range(1, 8)] + ["panda_finger_joint1", "panda_finger_joint2"]
    truth = {}
    with Writer(path, version=8) as writer:
        topics = {"exo": ("/cameras/exo/image_raw", Image), "wrist": ("/cameras/wrist/image_raw", Image),
                  "arm": ("/joint_states", JointState), "gripper": ("/joint_states", JointState),
                  "instruction": ("/instruction", String)}
        connections = {}
        for kind, (topic, msgtype) in topics.items():
            if topic not in connections:
                connections[topic] = writer.add_connection(topic, msgtype.__msgtype__, typestore=TYPES)

        def write(kind, log_s, msg):
            topic, msgtype = topics[kind]
            writer.write(connections[topic], START_NS + int(log_s * 1e9), TYPES.serialize_cdr(msg, msgtype.__msgtype__))

        for log_s, kind, t in events:
            if kind == "instruction":
                write(kind, log_s, String(data=t))
                continue
            ns = START_NS + int(round((t - (STEP_BACK_S if t >= STEP_AT_S else 0.0)) * 1e9))
            if kind == "wrist" and variant == "behind":
                ns -= 2 * 10**9
            if kind == "wrist" and variant == "unstamped":
                ns = 0
            header = Header(stamp=Time(sec=ns // 10**9, nanosec=ns % 10**9), frame_id=kind)
            if kind in ("exo", "wrist"):
                truth[kind, ns] = (t, None)
                encoding, step = ("yuv422_yuy2", 2 * WIDTH) if kind == "exo" else ("bayer_rggb8", WIDTH)
                data = rng.integers(0, 255, HEIGHT * step, dtype=np.uint8)
                write(kind, log_s, Image(header=header, height=HEIGHT, width=WIDTH, encoding=encoding, is_bigendian=0,
                                         step=step, data=data))
                continue
            q = [0.3 * np.sin(t + i) for i in range(7)] + [0.04 * (1 + np.sin(t)) / 2]
            names, values = (arm_names, q[:7] + [0.02, 0.02]) if kind == "arm" else (["panda_gripper"], q[7:])
            order = rng.permutation(len(names))
            names, values = [names[k] for k in order], [float(values[k]) for k in order]
            for name, x in zip(names, values):
                truth[name, ns] = (t, x)
            write(kind, log_s, JointState(header=header, name=names, position=np.array(values),
                                          velocity=np.array([], float), effort=np.array([], float)))
    return truth


def problems(truth: dict, frames: list, state: np.ndarray, stamps) -> list[str]:
    times = [truth[key][0] for key in frames]
    joints = [truth[name, int(s)] for name, s in zip(PANDA_JOINTS, stamps)]
    found = []
    if len({t >= STEP_AT_S for t in times + [t for t, _ in joints]}) > 1:
        found.append("mixes timelines")
    if not np.allclose(state, [x for _, x in joints], atol=1e-6):
        found.append("state is not the values written")
    if len(frames) == 4 and abs(times[2] - times[0] - OFFSET_S) > 1 / EXO_HZ + 0.005:
        found.append("history frame not offset_s back")
    return found


def offline(path: Path) -> tuple[dict, object]:
    layout = LAYOUTS["droid"]
    with Bag(path) as bag:
        stream = ObservationStream(bag, resolve_inputs(bag, layout.cameras), layout, OFFSET_S)
        return {f.stamp_ns: f for f in stream}, stream


def live(path: Path, out: Path, bag_stamps) -> tuple[dict, list]:
    """The node's observations, on the bag's stamps."""
    with NodeProcess(tiny_config(), out / "node.log", {"camera_height": HEIGHT, "camera_width": WIDTH},
                     ("--log-level", "vla_node:=debug")) as node:
        summary = replay_live(LiveOptions(bag=path, out=out / "live", wait_s=120.0, abort_if=node.exited),
                              progress=lambda m: None)
    return summary, logged_observations((out / "node.log").read_text(), bag_stamps)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variant", choices=("mixed", "behind", "unstamped", "slow-gripper"), default="mixed")
    parser.add_argument("--out", type=Path, default=Path("out/probe"))
    parser.add_argument("--offline-only", action="store_true")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.variant}_bag"
    shutil.rmtree(path, ignore_errors=True)
    truth = write_bag(path, args.variant)
    queries, stream = offline(path)
    bad = Counter(p for q in queries.values()
                  for p in problems(truth, q.observation.frame_ids, q.observation.state, q.state_stamps_ns))
    report = {"variant": args.variant, "offline_queries": len(queries), "offline_problems": dict(bad),
              "offline_stats": vars(stream.stats), "offline_last_wait": getattr(stream.last_wait, "reason", None),
              "offline_last_refusal": stream.last_refusal}
    if not args.offline_only:
        summary, observations = live(path, args.out / f"live_{args.variant}", queries)
        bad, same, differ, unmatched = Counter(), 0, [], 0
        for frames, state, stamps in observations:
            bad.update(problems(truth, frames, state, stamps))
            query = queries.get(frames[-2][1])
            if query is None:
                unmatched += 1
            elif frames == query.observation.frame_ids and stamps.tolist() == query.state_stamps_ns.tolist():
                same += 1
            else:
                differ.append({"live": frames, "offline": query.observation.frame_ids})
        report.update(live_observations=len(observations), live_problems=dict(bad), same_as_offline=same,
                      differ_from_offline=differ, not_queried_offline=unmatched, chunks=summary["chunks"],
                      holds=[f"{c['t_s']:.2f} s {c['status']}" for c in summary["holds"]["changes"]])
    (args.out / f"{args.variant}.json").write_text(json.dumps(report, indent=1, default=str))
    for key, value in report.items():
        if key == "holds":
            print("holds:")
            for line in value:
                print(f"  {line[:200]}")
        else:
            print(f"{key}: {value if not isinstance(value, list) else len(value)}")


if __name__ == "__main__":
    main()
