"""Parameters over the parameter services of a running node: described with ranges, invalid sets
rejected with a reason and nothing changed, run-time changes taking effect without a restart."""
import time

import numpy as np
import pytest
from rcl_interfaces.srv import DescribeParameters
from std_msgs.msg import String

from ros_helpers import Harness, NodeProcess, Robot, assert_ticks_at, command_stamps_ns, stamp_ns
from vla_node.ros.diagnostics import Key

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def node():
    proc = NodeProcess({"autostart": True, "publish_joint_command": True})
    h = Harness(proc)
    try:
        Robot(h)
        h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "the node to run", since=0)
        yield proc, h
    finally:
        h.close()
        proc.stop()


def assert_ticks_at_since(h, since: float, count: int, period_s: float) -> None:
    """The `count` control ticks after `since` run at `period_s`, by the node's stamps (the first
    two may predate the change)."""
    h.wait_until(lambda: len(h.messages("joint_command", since)) >= count + 2, 60, f"{count} commands")
    assert_ticks_at(period_s, command_stamps_ns(h, since)[2:])


def test_parameters_are_described_with_ranges_and_read_only_flags(node):
    _, h = node
    names = ["control_rate_hz", "replan_threshold", "model_preset", "camera_topics", "joint_lower_limits"]
    described = h.call(h.describe_params, DescribeParameters.Request(names=names), read_only=True).descriptors
    descriptors = {d.name: d for d in described}
    rate = descriptors["control_rate_hz"]
    assert rate.floating_point_range[0].from_value == 1.0 and rate.floating_point_range[0].to_value == 1000.0
    assert not rate.read_only and rate.description
    assert descriptors["replan_threshold"].integer_range[0].from_value == 1
    assert descriptors["model_preset"].read_only and descriptors["camera_topics"].read_only
    assert not descriptors["joint_lower_limits"].read_only
    assert h.get_parameter("camera_topics") == ["cameras/exo/image_raw", "cameras/wrist/image_raw"]   # relative


@pytest.mark.parametrize("name, value, reason", [
    ("control_rate_hz", 5000.0, ""),                          # out of the descriptor's range (rclpy's words)
    ("control_rate_hz", "fast", "control_rate_hz must be a double"),     # wrong type: start-up's sentence
    ("control_rate_hz", 30, "control_rate_hz must be a double, written with a decimal point (15.0, not 15)"),
    ("replan_threshold", 17, "exceeds the model's horizon 16"),
    ("handover", "blend", "handover must be one of"),
    ("joint_lower_limits", [5.0] * 8, "below joint_upper_limits"),
    ("max_step_per_tick", [0.1, 0.1], "max_step_per_tick has 2 values"),
    ("model_preset", "molmobot-4b", "read-only"),
    ("camera_topics", ["/a", "/b"], "read-only"),
])
def test_invalid_sets_are_rejected_with_a_reason_and_change_nothing(node, name, value, reason):
    _, h = node
    before = h.get_parameter(name)
    result = h.set_parameter(name, value)
    assert not result.successful
    assert reason.lower() in result.reason.lower() and result.reason
    assert h.get_parameter(name) == before


def planned_period_ns(h, since: float) -> int:
    """The control period of the first chunk published after `since` (its points' spacing)."""
    traj = h.wait_until(lambda: h.messages("trajectory", since), 60, "a trajectory")[-1]
    return traj.points[1].time_from_start.nanosec


def test_control_rate_changes_at_run_time(node):
    _, h = node
    assert h.set_parameter("control_rate_hz", 25.0).successful
    try:
        assert_ticks_at_since(h, time.monotonic(), 40, 1 / 25.0)     # never faster than 25 Hz now
        # 40 ticks at the new rate: any chunk arriving now is planned at it.
        assert planned_period_ns(h, time.monotonic()) == 40_000_000
    finally:
        assert h.set_parameter("control_rate_hz", 50.0).successful
    assert_ticks_at_since(h, time.monotonic(), 80, 1 / 50.0)
    assert planned_period_ns(h, time.monotonic()) == 20_000_000


def test_chunks_that_come_too_late_are_counted_apart_and_publish_nothing(node):
    _, h = node
    # At 1 kHz the 16-action horizon lasts 16 ms, less than one tiny-model inference on the CPU:
    # every chunk arrives after its last action's tick.
    before = h.diagnostics_since(0)[-1]
    assert h.set_parameter("control_rate_hz", 1000.0).successful
    try:
        late = h.wait_diagnostics(lambda d: int(d[Key.LATE_CHUNKS]) > int(before[Key.LATE_CHUNKS]) + 2, 30,
                                  "late chunks")
        later = h.wait_diagnostics(lambda d: int(d[Key.LATE_CHUNKS]) > int(late[Key.LATE_CHUNKS]) + 2, 30,
                                   "more late chunks")
        # A late chunk leaves no trajectory; a chunk that did make it in published one (stamped
        # with its first point's tick, up to a tick after it was counted).
        between = [t for t in h.messages("trajectory")
                   if late["_stamp_ns"] < stamp_ns(t.header.stamp) <= later["_stamp_ns"]]
        assert len(between) <= int(later[Key.CHUNKS]) - int(late[Key.CHUNKS]) + 1
    finally:
        assert h.set_parameter("control_rate_hz", 50.0).successful
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 3, 60, "trajectories again at 50 Hz")


def test_limits_change_at_run_time_and_commands_obey_them(node):
    _, h = node
    upper = [2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973, 1.0]
    tight = [0.01, -0.45, 0.01, -1.9, 0.01, 1.4, 0.7, 0.4]       # just above the start position
    assert h.set_parameter("joint_upper_limits", tight).successful
    try:
        since = time.monotonic()
        # Commands move into the new limits at max_step_per_tick, then stay inside.
        h.wait_until(lambda: [m for m in h.messages("command", since) if np.all(np.array(m.data) <= tight)],
                     60, "commands inside the tightened limits")
        settled = time.monotonic()
        commands = np.array([m.data for m in h.wait_commands(20, since=settled)])
        assert (commands <= np.array(tight) + 1e-9).all()
    finally:
        assert h.set_parameter("joint_upper_limits", upper).successful


def test_handover_and_blending_change_at_run_time(node):
    _, h = node
    for name, value in (("handover", "average"), ("average_weight", 0.8), ("blend_steps", 2),
                        ("replan_threshold", 10), ("input_timeout_s", 1.0), ("sync_slop_s", 0.03)):
        assert h.set_parameter(name, value).successful, name
        assert h.get_parameter(name) == value
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 3, 60, "chunks with the average hand-over")
    assert h.set_parameter("handover", "inpaint").successful   # requests now carry the frozen actions
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 3, 60, "chunks with the inpaint hand-over")
    assert h.set_parameter("handover", "rtc").successful


def test_instruction_topic_sets_the_instruction_parameter(node):
    _, h = node
    h.wait_until(lambda: h.instruction_pub.get_subscription_count() > 0, 60, "the instruction subscription")
    h.instruction_pub.publish(String(data="  stack the blocks  "))
    h.wait_until(lambda: h.get_parameter("instruction") == "stack the blocks", 60, "the new instruction")
    assert h.set_parameter("instruction", "open the drawer").successful
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 2, 60, "chunks for the new instruction")


def test_action_cache_schedule_changes_at_run_time_and_an_invalid_one_is_refused(node):
    proc, h = node
    assert h.set_parameter("action_cache", "3-6:2").successful          # 10 flow steps: steps 3-6 reuse 2
    proc.wait_for_line("action_cache '3-6:2' in effect")
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 2, 60, "chunks with the action cache")
    result = h.set_parameter("action_cache", "5:7")
    assert not result.successful and "can only reuse an earlier step" in result.reason
    assert h.get_parameter("action_cache") == "3-6:2"
    assert h.set_parameter("action_cache", "").successful
    proc.wait_for_line("action_cache '' in effect")
