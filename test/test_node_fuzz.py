"""Property-based fuzzing of a live node: random malformed messages (wrong sizes, encodings and
steps, corrupt or oversize compressed data, NaN/inf, missing and duplicate joint names, huge,
negative and invalid stamps, empty and 1 MB instructions) replace one input's messages for a
moment. For every one, the node stays up, reports the input on /diagnostics, holds, and runs
again once the input is good.

The budget is fixed (FUZZ_EXAMPLES cases, the same ones every run: derandomized); set
VLA_FUZZ_EXAMPLES and VLA_FUZZ_SEED to fuzz longer or elsewhere.
"""
import os
import time
from dataclasses import dataclass
from typing import Callable, Optional

import cv2
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from hypothesis import HealthCheck, Phase, event, example, given, seed, settings
from hypothesis import strategies as st
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import String

from ros_helpers import CAMERA_TOPICS, JOINTS, Harness, NodeProcess, Robot, assert_commands_safe
from vla_node.ros.diagnostics import Key

FUZZ_EXAMPLES = int(os.environ.get("VLA_FUZZ_EXAMPLES", "20"))
pytestmark = pytest.mark.timeout(120 + 20 * FUZZ_EXAMPLES)

H, W = 480, 640
HOME = [0.0, -0.5, 0.0, -2.0, 0.0, 1.5, 0.8, 0.5]
INSTRUCTION = "pick up the red cup and put it in the bowl"


# The hold causes that report each input (the node's fault sources start with these). Stamps off
# the other inputs' clock may show as frames or states that do not pair up ("sync").
SOURCES = {"exo": ("camera 'exo'",), "wrist": ("camera 'wrist'",), "joints": ("joint",),
           "instruction": ("instruction", "engine")}


@dataclass
class Bad:
    """One malformed input: which input it replaces and how to make its messages."""
    kind: str
    input: str                       # "exo" (raw camera), "wrist" (jpeg camera), "joints", "instruction"
    make: Callable                   # cameras: f(stamp) -> msg; joints: f(stamp) -> msg; instruction: () -> str
    specific: bool = True            # the node must name this message's defect, not only its absence
    stamp: bool = False              # a stamp off the others' clock or timeline: "sync" or "timeline" may report it

    @property
    def sources(self) -> tuple:
        return SOURCES[self.input] + (("sync", "timeline") if self.stamp else ())

    def __repr__(self) -> str:       # what hypothesis prints for a failing case
        return f"Bad({self.kind!r} on {self.input})"


# -- strategies ----------------------------------------------------------------------------------
def raw(height, width, encoding="rgb8", step=None, size=None, stamp=None):
    step = width * 3 if step is None else step
    data = bytes(step * height if size is None else size)

    def make(now):
        msg = Image(height=height, width=width, encoding=encoding, step=step)
        msg.data = data
        msg.header.stamp = stamp or now
        return msg
    return make


def compressed(data: bytes, fmt="jpeg", stamp=None):
    def make(now):
        msg = CompressedImage(format=fmt, data=data)
        msg.header.stamp = stamp or now
        return msg
    return make


def joint_state(names, positions, stamp=None):
    def make(now):
        msg = JointState(name=list(names), position=[float(p) for p in positions])
        msg.header.stamp = stamp or now
        return msg
    return make


NON_ENCODING = st.text("abcdefghijklmnopqrstuvwxyz0123456789_", min_size=1, max_size=10).map(lambda t: f"x-{t}")
STAMPS = st.one_of(
    st.builds(Time, sec=st.just(2**31 - 1), nanosec=st.integers(0, 999_999_999)),          # year 2038
    st.builds(Time, sec=st.integers(-2**31, -1), nanosec=st.integers(0, 999_999_999)),       # before 1970
    st.builds(Time, sec=st.integers(0, 2**31 - 1), nanosec=st.integers(10**9, 2**32 - 1)))   # invalid nanosec
SMALL_JPEG = cv2.imencode(".jpg", np.full((32, 48, 3), 128, np.uint8))[1].tobytes()
JPEG = cv2.imencode(".jpg", np.full((H, W, 3), 128, np.uint8))[1].tobytes()

raw_images = st.one_of(
    st.tuples(st.integers(1, 1024), st.integers(1, 1024)).filter(lambda hw: hw != (H, W)).map(
        lambda hw: Bad(f"size {hw[1]}x{hw[0]}", "exo", raw(*hw))),
    NON_ENCODING.map(lambda e: Bad(f"encoding {e!r}", "exo", raw(H, W, e))),
    st.integers(-H * W * 3, 100_000).filter(bool).map(
        lambda d: Bad(f"data length {d:+d}", "exo", raw(H, W, size=H * W * 3 + d))),
    st.integers(0, W * 3 - 1).map(lambda s: Bad(f"step {s}", "exo", raw(H, W, step=s, size=s * H))),
    STAMPS.map(lambda t: Bad(f"stamp {t.sec}.{t.nanosec}", "exo", raw(H, W, stamp=t), specific=False, stamp=True)),
)
compressed_images = st.one_of(
    st.binary(max_size=4096).map(lambda b: Bad(f"{len(b)} random bytes", "wrist", compressed(b))),
    NON_ENCODING.map(lambda f: Bad(f"format {f!r}", "wrist", compressed(SMALL_JPEG, f))),
    st.just(Bad("a 32x48 jpeg", "wrist", compressed(SMALL_JPEG))),
    st.integers(2 * H * W * 3 + 65 * 1024, 3 * 2**20).map(
        lambda n: Bad(f"{n} bytes of jpeg", "wrist", compressed(bytes(n)))),
)
joint_states = st.one_of(
    st.tuples(st.integers(0, 7), st.sampled_from([float("nan"), float("inf"), float("-inf")])).map(
        lambda c: Bad(f"{c[1]} for {JOINTS[c[0]]}", "joints",
                      joint_state(JOINTS, HOME[:c[0]] + [c[1]] + HOME[c[0] + 1:]))),
    st.integers(0, 16).filter(lambda n: n != 8).map(
        lambda n: Bad(f"8 names, {n} positions", "joints", joint_state(JOINTS, (HOME * 2)[:n]))),
    st.integers(0, 7).map(lambda i: Bad(f"{JOINTS[i]} twice", "joints",
                                        joint_state(JOINTS + [JOINTS[i]], HOME + [HOME[i] + 0.3]))),
    st.sets(st.integers(0, 7), min_size=1, max_size=8).map(
        lambda gone: Bad(f"without {sorted(gone)}", "joints",
                         joint_state([j for i, j in enumerate(JOINTS) if i not in gone],
                                     [p for i, p in enumerate(HOME) if i not in gone]), specific=False)),
    STAMPS.map(lambda t: Bad(f"stamp {t.sec}.{t.nanosec}", "joints", joint_state(JOINTS, HOME, t),
                             specific=False, stamp=True)),
)
instructions = st.one_of(
    st.text(" \t\n", max_size=20).map(lambda t: Bad(f"blank {t!r}", "instruction", lambda: t)),
    st.just(Bad("1 MB", "instruction", lambda: "x" * 2**20)),
    st.integers(4097, 20_000).map(lambda n: Bad(f"{n} characters", "instruction", lambda: "a" * n)),
    st.integers(60, 400).map(lambda n: Bad(f"{n} words", "instruction", lambda: " ".join(["carefully"] * n))),
)
malformed = st.one_of(raw_images, compressed_images, joint_states, instructions)


# -- the live node ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rig():
    topics = [CAMERA_TOPICS[0], CAMERA_TOPICS[1] + "/compressed"]
    node = NodeProcess({"autostart": True, "camera_topics": topics})
    h = Harness(node)
    try:
        robot = Robot(h, compressed=(False, True))
        h.wait_diagnostics(lambda d: d["_message"] == "running", 120, "the node to run", since=0)
        yield node, h, robot
    finally:
        h.close()
        node.stop()


def inject(bad: Bad, h: Harness, robot: Robot) -> Callable[[], None]:
    """Replace the input's messages with the bad ones; returns what restores it."""
    if bad.input == "exo":
        robot.camera_messages[0] = lambda camera, stamp, seq: bad.make(stamp)
        return lambda: robot.camera_messages.pop(0)
    if bad.input == "wrist":
        robot.camera_messages[1] = lambda camera, stamp, seq: bad.make(stamp)
        return lambda: robot.camera_messages.pop(1)
    if bad.input == "joints":
        robot.joint_message = bad.make
        return lambda: setattr(robot, "joint_message", None)
    h.instruction_pub.publish(String(data=bad.make()))
    return lambda: h.instruction_pub.publish(String(data=INSTRUCTION))


def reported(d: dict, bad: Bad) -> Optional[str]:
    """The fault that reports `bad`'s input, if any: its source and reason."""
    for fault in d[Key.FAULTS].split("; "):
        source, _, reason = fault.partition(": ")
        if source.startswith(bad.sources) and (not bad.specific or not source.endswith("stale")):
            return fault
    return None


@settings(max_examples=FUZZ_EXAMPLES, deadline=None, derandomize="VLA_FUZZ_SEED" not in os.environ,
          database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@seed(int(os.environ.get("VLA_FUZZ_SEED", "0")))
@given(bad=malformed)
# The extremes, in every run: a camera frame from 2038 and one from before 1970, a 1 MB
# instruction, a joint named twice.
@example(bad=Bad("stamp 2038", "exo", raw(H, W, stamp=Time(sec=2**31 - 1)), specific=False, stamp=True))
@example(bad=Bad("stamp 1969", "wrist", compressed(JPEG, stamp=Time(sec=-1)), specific=False, stamp=True))
@example(bad=Bad("1 MB", "instruction", lambda: "x" * 2**20))
@example(bad=Bad("panda_gripper twice", "joints", joint_state(JOINTS + ["panda_gripper"], HOME + [0.9])))
def test_random_malformed_input_is_reported_held_and_recovered_from(rig, bad):
    node, h, robot = rig
    event(f"{bad.input}: {bad.kind.split()[0]}")     # --hypothesis-show-statistics lists what ran
    # The node runs before the case: its newest report says so (the one the case before ended on),
    # else a new one must. (Reports come a second apart unless something changed: waiting for a new
    # one each time cost a second a case.)
    if h.newest_running() is None:
        h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "the node to run before the case")
    h.wait_until(lambda: h.instruction_pub.get_subscription_count() > 0, 20, "the instruction subscription")
    start = time.monotonic()
    restore = inject(bad, h, robot)
    try:
        d = h.wait_diagnostics(lambda d: reported(d, bad), 30, f"{bad} reported", since=start)
        assert d["_level"] == 2 and d["_message"].startswith("holding: ")
        assert node.proc.poll() is None
    finally:
        restore()
    h.wait_diagnostics(lambda r: r["_message"] == "running" and r["_stamp_ns"] > d["_stamp_ns"], 30,
                       f"recovery from {bad}", since=start)
    assert node.proc.poll() is None


def test_every_command_during_the_fuzzing_was_finite_within_limits_and_step(rig):
    _, h, _ = rig
    commands = np.array([m.data for m in h.messages("command")])
    assert len(commands) > 100
    assert_commands_safe(commands)
