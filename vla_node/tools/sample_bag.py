"""A synthetic but realistic DROID-style recording: a Franka-like arm picks up a red cup and puts
it in a bowl, seen by an exterior and a wrist camera (640x480, 15 Hz, JPEG), with joint states at
100 Hz, the instruction, and the demonstration's next 16 actions per camera frame as reference.

Flat-shaded drawings keep the JPEGs small, so a few seconds fit in the repository. Everything is
a pure function of time, so the same arguments always write the same messages.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import cv2
import numpy as np

from .bag_io import (
    CAMERA_TOPICS,
    CLOCK,
    CLOCK_TOPIC,
    IMAGE,
    INSTRUCTION_TOPIC,
    JOINT_NAMES,
    JOINT_STATE,
    JOINT_STATES_TOPIC,
    JOINT_TRAJECTORY,
    REFERENCE_TOPIC,
    STRING,
    BagWriter,
    clock_msg,
    image_msg,
    joint_state_msg,
    joint_trajectory_msg,
    string_msg,
)
from .sample_scene import (
    CAMERA_HZ,
    RENDERERS,
    joint_positions,
    joint_velocities,
)

# The bag shipped with the package (made by scripts/make_sample_bag.py with the defaults).
SAMPLE_BAG = Path(__file__).resolve().parents[1] / "data" / "sample_droid.mcap"
INSTRUCTION = "pick up the red cup and put it in the bowl"
START_NS = 1_700_000_000 * 1_000_000_000   # a fixed epoch: the bag is reproducible byte for byte
JOINT_STATE_HZ = 100.0
REFERENCE_HORIZON = 16
# Wrist frames are exposed 7 ms before exterior frames and every image reaches the recorder
# 12 ms after exposure, so the exterior frame (the query trigger) arrives last of each pair.
CAMERA_OFFSETS_NS = {"exo": 10_000_000, "wrist": 3_000_000}
IMAGE_TRANSPORT_NS = 12_000_000
JOINT_STATE_TRANSPORT_NS = 500_000



@dataclass(frozen=True)
class SampleSpec:
    duration_s: float = 6.0
    compressed: bool = True        # CompressedImage (JPEG) on <topic>/compressed, else raw rgb8 Image
    reference: bool = True         # reference actions on REFERENCE_TOPIC
    jpeg_quality: int = 80


def write_sample_bag(path: str | Path, spec: SampleSpec = SampleSpec(), storage: str = "mcap",
                     progress=None) -> Path:
    """Write the sample recording to `path` (a bag directory, or a single .mcap / .db3 file)."""
    path = Path(path)
    events = []   # (log time ns, order, topic, msgtype, message factory)
    camera_period = 1e9 / CAMERA_HZ
    frames = int(spec.duration_s * CAMERA_HZ)
    for camera, topic in zip(("exo", "wrist"), CAMERA_TOPICS):
        for i in range(frames):
            stamp = START_NS + int(round(i * camera_period)) + CAMERA_OFFSETS_NS[camera]
            events.append((stamp + IMAGE_TRANSPORT_NS, 1, camera, stamp, topic))
    for i in range(int(spec.duration_s * JOINT_STATE_HZ)):
        stamp = START_NS + int(round(i * 1e9 / JOINT_STATE_HZ))
        events.append((stamp + JOINT_STATE_TRANSPORT_NS, 0, "joints", stamp, JOINT_STATES_TOPIC))
    events.append((START_NS, -1, "instruction", START_NS, INSTRUCTION_TOPIC))
    events.sort(key=lambda e: (e[0], e[1]))
    step_ns = int(round(camera_period))
    with BagWriter(path, storage) as writer:
        for n, (log_ns, _, kind, stamp, topic) in enumerate(events):
            t = (stamp - START_NS) / 1e9
            if kind == "instruction":
                writer.write(topic, STRING, log_ns, string_msg(INSTRUCTION))
            elif kind == "joints":
                writer.write(topic, JOINT_STATE, log_ns,
                             joint_state_msg(stamp, JOINT_NAMES, joint_positions(t), joint_velocities(t)))
            else:
                rgb = RENDERERS[kind](t)
                writer.write_image(topic, log_ns, rgb, stamp, f"{kind}_camera_optical_frame",
                                   spec.jpeg_quality if spec.compressed else None)
                if kind == "exo" and spec.reference:
                    future = np.stack([joint_positions(t + (k + 1) * step_ns / 1e9) for k in range(REFERENCE_HORIZON)])
                    writer.write(REFERENCE_TOPIC, JOINT_TRAJECTORY, log_ns,
                                 joint_trajectory_msg(stamp, JOINT_NAMES, future, step_ns))
            if progress and n % 500 == 0:
                progress(f"{n}/{len(events)} messages")
    return path


# -- the same scene as real robots record it ------------------------------------------------------
# The second bag shipped with the package (made by scripts/make_sample_bag.py --quirks).
QUIRKS_BAG = SAMPLE_BAG.with_name("sample_quirks.mcap")
ARM_JOINTS = JOINT_NAMES[:7]
GRIPPER = JOINT_NAMES[7]
# Joints of the arm driver's message, shuffled, with the finger joints the node does not use.
ARM_MESSAGE_JOINTS = ("panda_joint3", "panda_finger_joint1", "panda_joint1", "panda_joint7", "panda_joint2",
                      "panda_finger_joint2", "panda_joint5", "panda_joint4", "panda_joint6")
NEXT_INSTRUCTION = "put the cup back on the table"


@dataclass(frozen=True)
class QuirksSpec:
    """Input the way real robots produce it: a JPEG exterior camera and a bgr8 wrist camera at 30 Hz
    with stamp jitter, the wrist exposed 10 ms after the exterior camera, a wrist-camera dropout,
    joint states shuffled with extra joints and the gripper in its own message (its own driver,
    rate and stamps), an instruction change, and stamps stepping back (a recorded simulation reset:
    /clock steps back with them). Stamps are simulated time; log times are the recorder's wall
    clock, which never steps back."""
    duration_s: float = 6.0
    camera_hz: float = 30.0
    jitter_s: float = 0.003            # each camera stamp within +- this of its nominal time
    joint_jitter_s: float = 0.0002     # each joint state stamp within +- this of its nominal time
    wrist_delay_s: float = 0.010
    dropout_s: tuple = (2.0, 2.8)      # the wrist camera is silent in this span
    arm_hz: float = 100.0
    gripper_hz: float = 50.0
    gripper_delay_s: float = 0.003     # gripper stamps lag the arm's by this much
    instruction_change_s: float = 3.2
    steps: tuple = ((4.2, 2.0),)       # (at s, back s): every stamp from then on is that much earlier
    clock_hz: float = 100.0
    size: tuple = (120, 160)           # (height, width): small, the bag is shipped
    seed: int = 0

    def stamp_ns(self, t: float) -> int:
        """The stamp (simulated time) of something that happened t s into the recording."""
        return START_NS + int(round((t - sum(back for at, back in self.steps if t >= at)) * 1e9))


def write_quirks_bag(path: str | Path, spec: QuirksSpec = QuirksSpec(), storage: str = "mcap") -> Path:
    """Write the quirky recording to `path`; messages are a pure function of `spec`."""
    rng = np.random.default_rng(spec.seed)
    events = []   # (log time ns, order, kind, t)
    period = 1.0 / spec.camera_hz
    for i in range(int(spec.duration_s * spec.camera_hz)):
        for kind, delay in (("exo", 0.0), ("wrist", spec.wrist_delay_s)):
            t = i * period + delay + rng.uniform(-spec.jitter_s, spec.jitter_s)
            if kind == "wrist" and spec.dropout_s[0] <= t < spec.dropout_s[1]:
                continue
            events.append((t + IMAGE_TRANSPORT_NS / 1e9, 1, kind, t))
    for kind, hz, delay in (("arm", spec.arm_hz, 0.0), ("gripper", spec.gripper_hz, spec.gripper_delay_s)):
        for i in range(int(spec.duration_s * hz)):
            t = i / hz + delay + rng.uniform(-spec.joint_jitter_s, spec.joint_jitter_s)
            events.append((t + JOINT_STATE_TRANSPORT_NS / 1e9, 0, kind, t))
    events += [(i / spec.clock_hz, -1, "clock", i / spec.clock_hz)
               for i in range(int(spec.duration_s * spec.clock_hz))]
    events += [(0.0, -2, "instruction", INSTRUCTION), (spec.instruction_change_s, -2, "instruction", NEXT_INSTRUCTION)]
    events.sort(key=lambda e: (e[0], e[1]))
    height, width = spec.size
    with BagWriter(path, storage, compress=True) as writer:
        for log_s, _, kind, t in events:
            log_ns = START_NS + int(round(log_s * 1e9))
            if kind == "instruction":
                writer.write(INSTRUCTION_TOPIC, STRING, log_ns, string_msg(t))
                continue
            stamp = spec.stamp_ns(t)
            if kind == "clock":
                writer.write(CLOCK_TOPIC, CLOCK, log_ns, clock_msg(stamp))
            elif kind == "arm":
                q = dict(zip(JOINT_NAMES, joint_positions(t)))
                positions = [q.get(name, 0.02) for name in ARM_MESSAGE_JOINTS]   # fingers: 2 cm
                writer.write(JOINT_STATES_TOPIC, JOINT_STATE, log_ns, joint_state_msg(stamp, ARM_MESSAGE_JOINTS,
                                                                                      positions))
            elif kind == "gripper":
                writer.write(JOINT_STATES_TOPIC, JOINT_STATE, log_ns,
                             joint_state_msg(stamp, (GRIPPER,), joint_positions(t)[7:]))
            else:
                rgb = cv2.resize(RENDERERS[kind](t), (width, height), interpolation=cv2.INTER_AREA)
                frame_id = f"{kind}_camera_optical_frame"
                if kind == "exo":
                    writer.write_image(CAMERA_TOPICS[0], log_ns, rgb, stamp, frame_id, jpeg_quality=85)
                else:
                    writer.write(CAMERA_TOPICS[1], IMAGE, log_ns, image_msg(rgb, stamp, frame_id, "bgr8"))
    return Path(path)


@dataclass(frozen=True)
class InterleavedSpec:
    """A recording across a simulation reset whose log order interleaves the old and the new
    timeline for `overlap_s` (both clocks' messages arrive alternately): timeline 0 from log time 0
    to reset_s + overlap_s, timeline 1 (the new simulation) from reset_s to duration_s, its clock
    `back_s` behind. With back_s 0 (the default) the two timelines carry the same stamps: joint
    states on exact 10 ms stamps repeat each other's stamps with other values, and a camera's
    stamps step back only when jitter orders them so. Arm and gripper in separate messages, 30 Hz
    cameras with jitter. Stamps and log times are seconds after START_NS."""
    duration_s: float = 7.0
    reset_s: float = 2.5
    overlap_s: float = 2.0
    back_s: float = 0.0
    camera_hz: float = 30.0
    jitter_s: float = 0.003
    wrist_delay_s: float = 0.005
    joint_hz: float = 100.0
    size: tuple = (96, 128)
    seed: int = 0

    def spans(self) -> tuple[tuple[float, float, float], ...]:
        """(first, last log time, clock behind the log) of each timeline."""
        return (0.0, self.reset_s + self.overlap_s, 0.0), (self.reset_s, self.duration_s, self.back_s)


def interleaved_positions(timeline: int, stamp_s: float) -> np.ndarray:
    """[8] the joints of `timeline` at a stamp (seconds after START_NS): different per timeline."""
    return joint_positions(stamp_s % 6.0) + 0.05 * timeline


def write_interleaved_bag(path: str | Path, spec: InterleavedSpec = InterleavedSpec()) -> dict:
    """Write the recording (InterleavedSpec); returns (camera or joint, stamp ns) -> {timeline: value}
    for every frame (value None) and joint sample."""
    rng = np.random.default_rng(spec.seed)
    events = []   # (log s, order, timeline, kind, stamp s)
    for timeline, (first, last, zero) in enumerate(spec.spans()):
        for i in range(int(np.ceil((last - first) * spec.camera_hz))):
            for kind, delay in (("exo", 0.0), ("wrist", spec.wrist_delay_s)):
                t = first + i / spec.camera_hz + delay + rng.uniform(-spec.jitter_s, spec.jitter_s)
                if t < last:
                    events.append((t + IMAGE_TRANSPORT_NS / 1e9, 1, timeline, kind, t - zero))
        for i in range(int(round((last - first) * spec.joint_hz))):
            t = first + i / spec.joint_hz
            for kind in ("arm", "gripper"):
                events.append((t + JOINT_STATE_TRANSPORT_NS / 1e9, 0, timeline, kind, round(t - zero, 2)))
    events.append((0.0, -1, 0, "instruction", INSTRUCTION))
    events.sort(key=lambda e: (e[0], e[1]))
    truth: dict = {}
    height, width = spec.size
    with BagWriter(path, "mcap") as writer:
        for log_s, _, timeline, kind, t in events:
            log_ns = START_NS + int(round(log_s * 1e9))
            if kind == "instruction":
                writer.write(INSTRUCTION_TOPIC, STRING, log_ns, string_msg(t))
                continue
            stamp = START_NS + int(round(t * 1e9))
            if kind in ("exo", "wrist"):
                while (kind, stamp) in truth:   # camera stamps never coincide: a frame's stamp names its timeline
                    stamp += 1000
                truth[kind, stamp] = {timeline: None}
                rgb = np.full((height, width, 3), 60 + 120 * timeline, np.uint8)
                rgb[:, :, 1] = int(t * 40) % 256
                topic = CAMERA_TOPICS[0] if kind == "exo" else CAMERA_TOPICS[1]
                writer.write(topic, IMAGE, log_ns, image_msg(rgb, stamp, f"{kind}_camera_optical_frame"))
                continue
            q = interleaved_positions(timeline, t)
            names = ARM_JOINTS if kind == "arm" else (GRIPPER,)
            values = q[:7] if kind == "arm" else q[7:]
            for name, x in zip(names, values):
                truth.setdefault((name, stamp), {})[timeline] = float(x)
            writer.write(JOINT_STATES_TOPIC, JOINT_STATE, log_ns, joint_state_msg(stamp, names, values))
    return truth


def timelines_of(truth: dict, frames, state, state_stamps) -> set:
    """The timelines an observation's frames ((camera, stamp) ids) and joint samples (the state's
    values at their stamps, joint_names order) come from."""
    found = {next(iter(truth[tuple(key)])) for key in frames}
    for name, x, stamp in zip(JOINT_NAMES, state, state_stamps):
        found |= {timeline for timeline, value in truth[name, int(stamp)].items() if abs(value - x) < 1e-5}
    return found


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", help="output: a bag directory, or a single .mcap / .db3 file")
    parser.add_argument("--quirks", action="store_true",
                        help="the scene as real robots record it (QuirksSpec: 30 Hz jpeg + bgr8 cameras with jitter, "
                             "a dropout, split and shuffled joint states, stamps stepping back, /clock)")
    parser.add_argument("--duration", type=float, default=SampleSpec.duration_s, help="seconds (default %(default)s)")
    parser.add_argument("--storage", choices=("mcap", "sqlite3"), default="mcap",
                        help="for a bag directory (a file's suffix decides otherwise)")
    parser.add_argument("--raw", action="store_true", help="raw rgb8 Image instead of JPEG CompressedImage")
    parser.add_argument("--no-reference", action="store_true", help=f"leave out {REFERENCE_TOPIC}")
    parser.add_argument("--jpeg-quality", type=int, default=SampleSpec.jpeg_quality)
    args = parser.parse_args(argv)
    if args.quirks:
        path = write_quirks_bag(args.path, QuirksSpec(duration_s=args.duration), args.storage)
    else:
        spec = SampleSpec(duration_s=args.duration, compressed=not args.raw, reference=not args.no_reference,
                          jpeg_quality=args.jpeg_quality)
        path = write_sample_bag(args.path, spec, args.storage, progress=print)
    size = sum(p.stat().st_size for p in ([path] if path.is_file() else path.rglob("*")))
    print(f"wrote {path} ({size / 1e6:.1f} MB, {args.duration:g} s)")
