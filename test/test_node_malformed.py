"""Malformed inputs against a running node: for each, the node stays up, holds position, reports
the cause once in the log and on /diagnostics, and resumes when the input is good again.

One camera is raw (sensor_msgs/Image) and one JPEG (sensor_msgs/CompressedImage), so both
decoding paths are covered by the same node. The cases share that node but not their fate: each
restores its input whatever happens, and a node that does not run again before a case is
replaced by a fresh one (the case that broke it has failed already).
"""
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import cv2
import numpy as np
import pytest
from builtin_interfaces.msg import Time
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Bool, String

from ros_helpers import CAMERA_TOPICS, JOINTS, Harness, NodeProcess, Robot, assert_commands_safe, stamp_ns
from vla_node.ros.diagnostics import LOG_BURST, LOG_WINDOW_S, Key
from vla_node.ros.outputs import DIAGNOSTICS_PERIOD_S
from vla_node.ros.params import SPECS

pytestmark = pytest.mark.timeout(300)



# Inputs are stale after this long. The harness publishes its robot's inputs from this process: on
# the 2-core VM beside three busy loops its 50 Hz joint states paused for up to 0.36 s (measured),
# and a pause longer than the timeout was a second, unrelated hold within a case (issue 18). The
# cases that silence an input keep it silent until they restore it, so any timeout shows them.
INPUT_TIMEOUT_S = 3.0


class Rig:
    """The node under test, its harness and its robot; `before`: the node's report that it runs,
    taken before the case (the fixture `rig`); `settled`: the case that used it last passed,
    ending on a report that the node runs."""

    def __init__(self):
        topics = [CAMERA_TOPICS[0], CAMERA_TOPICS[1] + "/compressed"]
        self.node = NodeProcess({"autostart": True, "camera_topics": topics, "publish_joint_command": True,
                                 "input_timeout_s": INPUT_TIMEOUT_S})
        self.h = Harness(self.node)
        self.before: Optional[dict] = None
        self.settled = False
        try:
            self.robot = Robot(self.h, compressed=(False, True))
            self.before = self.h.wait_diagnostics(lambda d: d["_message"] == "running", 120, "the node to run",
                                                  since=0)
            self.settled = True
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        self.h.close()
        self.node.stop()


@pytest.fixture(scope="module")
def rigs():
    current = [Rig()]
    yield current
    current[0].close()


@pytest.fixture
def rig(rigs):
    """The module's rig, running: after a case that passed (it ended on a report that the node
    runs), the node's newest report if it still says so; else a new report that it runs, within
    60 s, or a fresh rig. Its report is `before`: the counts a case compares with. (A report is
    at least a second apart from the one before unless something changed: waiting for a new one
    cost a second a case.)"""
    current = rigs[0]
    settled, current.settled = current.settled, False
    current.before = current.h.newest_running() if settled else None
    if current.before is None:
        try:
            current.before = current.h.wait_diagnostics(lambda d: d["_message"] == "running", 60,
                                                        "the node to run before the case")
        except AssertionError:
            current.close()
            rigs[0] = current = Rig()
            current.settled = False
    return current


def image(height, width, encoding="rgb8", channels=3, data=None):
    def make(camera, stamp, seq):
        msg = Image(height=height, width=width, encoding=encoding, step=width * channels)
        msg.data = bytes(height * width * channels) if data is None else data
        msg.header.stamp = stamp
        return msg
    return make


def corrupt_jpeg(camera, stamp, seq):
    msg = CompressedImage(format="jpeg", data=b"\xff\xd8\xff\xe0" + bytes(range(256)) * 8)
    msg.header.stamp = stamp
    return msg


def older_stamp(robot):
    def make(camera, stamp, seq):
        # A copy: the robot stamps every camera's frame with the same object.
        return robot.image(camera, Time(sec=stamp.sec - 5, nanosec=stamp.nanosec), seq)
    return make


def joints(names, positions):
    def make(stamp):
        msg = JointState(name=names, position=positions)
        msg.header.stamp = stamp
        return msg
    return make


HOME_LIST = [0.0, -0.5, 0.0, -2.0, 0.0, 1.5, 0.8, 0.5]


@dataclass
class Case:
    name: str
    source: str          # the hold cause's source, as the node names it
    text: str            # what its reason must say ({ns}: the node's namespace)
    inject: Callable     # (robot, harness) -> restore()


def camera(index, make):
    """make: f(camera, stamp, seq) -> message, or older_stamp (which needs the robot)."""
    def inject(robot, h):
        robot.camera_messages[index] = make(robot) if make is older_stamp else make
        return lambda: robot.camera_messages.pop(index)
    return inject


def joint_stream(make):
    def inject(robot, h):
        robot.joint_message = make
        return lambda: setattr(robot, "joint_message", None)
    return inject


def dropout(robot, h):
    robot.cameras_on[1] = False
    return lambda: robot.cameras_on.__setitem__(1, True)


def publish(pub_name, bad, good):
    def inject(robot, h):
        pub = getattr(h, pub_name)
        h.wait_until(lambda: pub.get_subscription_count() > 0, 20, f"{pub_name} to match")
        pub.publish(bad)
        return lambda: pub.publish(good)
    return inject


def long_instruction(robot, h):
    assert h.set_parameter("instruction", " ".join(["carefully"] * 60)).successful
    return lambda: h.set_parameter("instruction", "pick up the red cup and put it in the bowl")


CASES = [
    Case("unsupported encoding", "camera 'exo'", "unsupported encoding '32FC1'",
         camera(0, image(480, 640, "32FC1", channels=4))),
    Case("wrong size", "camera 'exo'", "wrong image size 320x240", camera(0, image(240, 320))),
    Case("truncated data", "camera 'exo'", "truncated image data", camera(0, image(480, 640, data=bytes(1000)))),
    Case("oversize image", "camera 'exo'", "oversize image 1280x960", camera(0, image(960, 1280))),
    Case("corrupt jpeg", "camera 'wrist'", "corrupt jpeg data", camera(1, corrupt_jpeg)),
    # (The harness stamps both cameras' frames with one stamp object: both step back.)
    Case("stamps stepping back", "timeline", "stamps stepped back by", camera(0, older_stamp)),
    Case("camera dropout", "camera 'wrist' stale", "no camera 'wrist' input for more than", dropout),
    Case("nan joint", "joint_states", "non-finite joint positions for ['panda_joint4']",
         joint_stream(joints(JOINTS, HOME_LIST[:3] + [float("nan")] + HOME_LIST[4:]))),
    Case("inf joint", "joint_states", "non-finite joint positions for ['panda_gripper']",
         joint_stream(joints(JOINTS, HOME_LIST[:7] + [float("inf")]))),
    # Joint states are assembled by name across messages: silence of the joints is what holds.
    Case("unknown joints", "joint_states stale", "the latest message named only ['ur_joint0'",
         joint_stream(joints([f"ur_joint{i}" for i in range(6)], [0.0] * 6))),
    Case("missing joint", "joint_states stale", "no joint state for ['panda_gripper'] for more than",
         joint_stream(joints(JOINTS[:7], HOME_LIST[:7]))),
    Case("names and positions differ", "joint_states", "8 names but 7 positions",
         joint_stream(joints(JOINTS, HOME_LIST[:7]))),
    Case("empty instruction", "instruction", "empty instruction on {ns}/instruction",
         publish("instruction_pub", String(data="   "), String(data="pick up the red cup and put it in the bowl"))),
    Case("instruction over the token budget", "engine", f"the budget is {SPECS['max_instruction_tokens'].default}",
         long_instruction),
    Case("e-stop", "estop", "e-stop engaged on {ns}/estop", publish("estop_pub", Bool(data=True), Bool(data=False))),
]


def events(d: dict, source: str) -> int:
    for item in d[Key.HOLDS_BY_CAUSE].split(", "):
        name, _, count = item.rpartition("=")
        if name == source:
            return int(count)
    return 0


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_malformed_input_holds_reports_once_and_recovers(rig, case):
    node, h, robot, before = rig.node, rig.h, rig.robot, rig.before
    text = case.text.format(ns=node.namespace)
    logged = node.count(f"holding: {case.source}: ")
    resolved = node.count(f"resolved: {case.source}: ")
    frames, joint_msgs = robot.frame_count, robot.joint_count
    start = time.monotonic()
    restore = case.inject(robot, h)
    try:
        d = held(node, h, robot, case, text, start, frames, joint_msgs)
    finally:
        restore()

    resumed = h.wait_diagnostics(lambda r: r["_message"] == "running" and r["_stamp_ns"] > d["_stamp_ns"], 30,
                                 f"recovery from {case.name}", since=start)
    assert events(resumed, case.source) == events(before, case.source) + 1
    # The log arrives on another path than DDS: wait until it has caught up.
    node.wait_for_line(f"resolved: {case.source}: ", occurrence=resolved + 1)
    lines = [line for line in node.output().splitlines() if f"holding: {case.source}: " in line]
    assert len(lines) == logged + 1 and text in lines[-1], "\n".join(lines)
    since = time.monotonic()
    h.wait_until(lambda: h.messages("trajectory", since), 20, "a new chunk after recovery")
    rig.settled = True


def held(node, h, robot, case, text, start, frames, joint_msgs) -> dict:
    """While the bad input lasts: the cause on /diagnostics, the node up, one position held.
    Returns the report."""
    d = h.wait_diagnostics(lambda d: text in d["_message"], 30, f"{case.name} on /diagnostics", since=start)
    assert d["_level"] == 2 and text in d[Key.FAULTS]
    assert node.proc.poll() is None
    # Holding: every command the node stamped after it reported the cause holds one position.
    # (By the node's stamps, not by arrival here: on a loaded machine commands published before the
    # report can still be queued in this process when the report is taken in.)
    def held_commands():
        after = [tuple(m.position) for m in h.messages("joint_command")
                 if stamp_ns(m.header.stamp) > d["_stamp_ns"]]
        return after if len(after) >= 10 else None
    commands = h.wait_until(held_commands, 20, "10 commands stamped after the report")
    assert len(set(commands)) == 1, f"commands moved while holding for {case.name}"
    # Keep the bad input coming for a while: the cause is still reported only once.
    h.wait_until(lambda: robot.frame_count >= frames + 5 and robot.joint_count >= joint_msgs + 15, 30,
                 "more bad input")
    return d


def test_cases_cover_the_required_kinds():
    assert len(CASES) >= 12


def test_every_command_was_finite_within_limits_and_step(rig):
    commands = np.array([m.data for m in rig.h.messages("command")])
    assert len(commands) > 100
    assert_commands_safe(commands)
    rig.settled = True


def test_alternating_causes_keep_diagnostics_at_their_rate(rig):
    """A camera whose frames fail alternately for two reasons (or, before joint states were
    assembled by name, an arm and a gripper driver sharing /joint_states) changed the hold cause
    with every message: /diagnostics followed at the message rate and every change was logged."""
    node, h, robot = rig.node, rig.h, rig.robot
    logged = node.count("camera 'wrist': ")
    small = cv2.imencode(".jpg", np.zeros((240, 320, 3), np.uint8))[1].tobytes()

    def alternating(camera, stamp, seq):
        if seq % 2:
            return corrupt_jpeg(camera, stamp, seq)
        msg = CompressedImage(format="jpeg", data=small)    # decodes, but 320x240
        msg.header.stamp = stamp
        return msg
    robot.camera_messages[1] = alternating
    start = time.monotonic()
    first = h.wait_diagnostics(lambda d: "camera 'wrist'" in d["_message"], 30, "the wrist camera's fault",
                               since=start)
    frames = robot.frame_count
    h.wait_until(lambda: robot.frame_count >= frames + 60, 60, "4 s of alternating bad frames")   # 15 Hz
    robot.camera_messages.pop(1)
    span = time.monotonic() - start
    # Counted by the node's own stamps, from the fault's first report on: what it sent, not when
    # it arrived here (a busy machine delays and bunches arrivals). 1 Hz, and at most LOG_BURST
    # announcements per LOG_WINDOW_S (at the message rate before: 15 per second).
    stamps = [d["_stamp_ns"] for d in h.diagnostics_since(start) if d["_stamp_ns"] >= first["_stamp_ns"]]
    node_span = (max(stamps) - first["_stamp_ns"]) / 1e9
    bursts = LOG_BURST * (1 + math.floor(node_span / LOG_WINDOW_S))
    assert len(stamps) <= node_span / DIAGNOSTICS_PERIOD_S + 1 + bursts, \
        f"{len(stamps)} /diagnostics messages in {node_span:.1f} s"
    lines = node.count("camera 'wrist': ") - logged
    assert lines <= LOG_BURST * (1 + math.floor(span / LOG_WINDOW_S)), node.output()
    h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "recovery")
    rig.settled = True
