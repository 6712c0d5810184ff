"""The node as a user runs it: `vla-node --ros-args --params-file config/tiny.yaml` in its own
process, driven through its lifecycle services over DDS, fed synthetic camera + joint streams."""
import time

import numpy as np
import pytest
from rcl_interfaces.srv import DescribeParameters

from ros_helpers import (
    HOME,
    JOINTS,
    MAX_STEP,
    Harness,
    NodeProcess,
    Robot,
    assert_ticks_at,
    command_stamps_ns,
    pid_alive,
    stamp_ns,
)
from vla_node.ros.diagnostics import Key
from vla_node.ros.engine_protocol import LOADING, STARTING, WARMING_UP, WARMUP_GATE_ENV
from vla_node.ros.node import SUBSCRIBING
from vla_node.tools.node_process import dds_shm_of, dead_dds_shm

pytestmark = pytest.mark.timeout(300)

RATE = 50.0


@pytest.fixture(scope="module")
def running():
    node = NodeProcess({"publish_joint_command": True, "exit_on_finalize": False})   # finalized, it stays
    h = Harness(node)
    try:
        yield node, h
    finally:
        h.close()
        node.stop()


def test_starts_unconfigured_and_configure_loads_the_engine_in_a_process(running):
    node, h = running
    assert h.state() == "unconfigured"
    assert h.transition("configure")
    assert h.state() == "inactive"
    node.wait_for_line("loaded tiny on cpu")         # the engine's progress, forwarded to the log
    node.wait_for_line("ready in")
    d = h.wait_diagnostics(lambda d: d.get(Key.STATE) == "inactive", 30, "inactive diagnostics", since=0)
    assert pid_alive(int(d[Key.ENGINE_PID])) and int(d[Key.ENGINE_PID]) != node.proc.pid
    assert not h.messages("command")                 # configured is not commanding


def test_active_node_commands_at_the_configured_rate_and_publishes_trajectories(running):
    node, h = running
    Robot(h)
    h.wait_matched()
    assert h.transition("activate")
    h.wait_diagnostics(lambda d: d["_message"] == "running", 30, "the node to run")
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= 5, 60, "5 trajectories")
    start = time.monotonic()
    h.wait_until(lambda: len(h.messages("joint_command", start)) >= RATE * 3, 60, "3 s of commands")
    assert_ticks_at(1.0 / RATE, command_stamps_ns(h, start))     # by the node's stamps

    commands = np.array([m.data for m in h.messages("command", since)])
    assert commands.shape[1] == len(JOINTS) and np.isfinite(commands).all()
    joint_command = h.messages("joint_command", since)[-1]
    assert list(joint_command.name) == JOINTS and len(joint_command.position) == len(JOINTS)

    for traj in h.messages("trajectory", since):
        assert list(traj.joint_names) == JOINTS
        # What is left of a 16-action chunk once it arrives: 8 or more unless inference took longer
        # than 8 ticks, which a loaded machine does not promise.
        assert 1 <= len(traj.points) <= 16
        steps = [p.time_from_start.sec * 10**9 + p.time_from_start.nanosec for p in traj.points]
        assert steps == [i * 20_000_000 for i in range(len(steps))]
        assert all(len(p.positions) == len(JOINTS) for p in traj.points)
    # The header stamp is when the first point executes: the next control tick, which commands
    # at it or soon after (a busy machine delays some ticks). Most of them within half a period:
    # a stamp of the tick that published it would be a period before.
    ticks = np.sort(command_stamps_ns(h))
    until_next_tick_s = []
    for traj in h.messages("trajectory", since):
        later = ticks[np.searchsorted(ticks, stamp_ns(traj.header.stamp)):]
        if len(later):
            until_next_tick_s.append((later[0] - stamp_ns(traj.header.stamp)) / 1e9)
    assert len(until_next_tick_s) >= 5 and np.median(until_next_tick_s) < 0.5 / RATE, until_next_tick_s
    assert abs(ticks[-1] / 1e9 - time.time()) < 60       # the ROS clock: the system's, not a steady one


def test_commands_start_at_the_measured_position_and_stay_in_limits(running):
    node, h = running
    first = np.array(h.messages("command")[0].data)
    np.testing.assert_allclose(first, HOME)          # nothing planned yet: hold where the robot is
    commands = np.array([m.data for m in h.messages("command")])
    steps = np.abs(np.diff(commands, axis=0))
    assert (steps <= MAX_STEP + 1e-9).all()


def test_deactivate_stops_commands_and_cleanup_ends_the_engine_process(running):
    node, h = running
    pid = int(h.diagnostics_since(0)[-1][Key.ENGINE_PID])
    assert h.transition("deactivate")
    inactive = h.wait_diagnostics(lambda d: d.get(Key.STATE) == "inactive", 30, "inactive diagnostics")
    h.wait_diagnostics(lambda d: True, 30, "another diagnostics message")   # time passes, on the node's clock
    # Nothing stamped by the node after it reported inactive (judged by the node's stamps: on a
    # loaded machine earlier commands may still be queued here).
    assert not [m for m in h.messages("joint_command")
                if stamp_ns(m.header.stamp) > inactive["_stamp_ns"]]
    assert h.transition("cleanup")
    assert h.state() == "unconfigured"
    assert not pid_alive(pid)                                # the engine's memory went with it
    node.wait_for_line("cleaned up: engine process ended")


def test_configure_again_after_cleanup_and_shutdown(running):
    node, h = running
    assert h.transition("configure")
    assert h.transition("activate")
    h.wait_diagnostics(lambda d: d["_message"] == "running", 30, "the node to run again")
    pid = int(h.diagnostics_since(0)[-1][Key.ENGINE_PID])
    assert h.transition("shutdown")
    assert h.state() == "finalized"
    assert not pid_alive(pid)
    node.wait_for_line("shut down from active: engine process ended")


def test_after_shutdown_the_process_exits_with_code_0_unless_told_to_stay():
    """Issue 20: the process kept running finalized, and a launch with it (exit_on_finalize)."""
    node = NodeProcess({"autostart": True})
    h = Harness(node)
    try:
        d = h.wait_diagnostics(lambda d: d.get(Key.STATE) == "active", 120, "the node to be active", since=0)
        assert h.transition("shutdown")                  # answered before the process ends
        node.proc.wait(60)
    finally:
        h.close()
        code = node.stop()                               # joins the output reader
    assert code == 0, node.output()
    assert "finalized: exiting (exit_on_finalize)" in node.output()
    assert not pid_alive(int(d[Key.ENGINE_PID]))


def test_failed_load_fails_configure_with_the_reason(tmp_path):
    node = NodeProcess({"checkpoint": str(tmp_path / "missing")})
    h = Harness(node)
    try:
        assert not h.transition("configure")
        assert h.state() == "unconfigured"
        line = node.wait_for_line("configure failed")
        assert "does not exist" in line
        d = h.wait_diagnostics(lambda d: "configure failed" in d["_message"], 30, "the failure on /diagnostics",
                               since=0)
        assert "does not exist" in d["_message"] and d["_level"] == 2
        assert node.proc.poll() is None                      # still up, can be fixed and configured again
    finally:
        h.close()
        node.stop_cleanly()


def test_ctrl_c_ends_the_node_and_its_engine_process_and_leaves_no_shared_memory():
    node = NodeProcess({"autostart": True})
    h = Harness(node)
    try:
        Robot(h)
        d = h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "the node to run", since=0)
        pid = int(d[Key.ENGINE_PID])
        assert pid_alive(pid)
        mapped = dds_shm_of(node.proc.pid)        # its DDS participant's segment and ports, and others'
    finally:
        h.close()
        node.stop_cleanly()
    assert not pid_alive(pid)
    assert not dead_dds_shm(mapped), "the node's DDS participant was never destroyed"


def test_while_configure_waits_for_the_engine_the_node_answers_and_says_which_stage(tmp_path):
    """Issue 20: autostart configured in the constructor, before the node spun, so nothing answered
    until the model was warm (20-45 s on a GPU). The engine here waits at its warm-up until the
    test opens the gate: configure is under way for as long as the test looks."""
    gate = tmp_path / "warm-up gate"
    node = NodeProcess({"autostart": True}, env={WARMUP_GATE_ENV: str(gate)})
    h = Harness(node)
    try:
        h.wait_diagnostics(lambda d: d.get(Key.CONFIGURE_STAGE) == WARMING_UP, 120, "the warm-up stage", since=0)
        # Answered at all: configure waits at the gate until the test opens it.
        assert h.state() == "configuring"
        assert h.get_parameter("control_rate_hz") == 50.0                       # parameter services too
        request = DescribeParameters.Request(names=["control_rate_hz"])
        described = h.call(h.describe_params, request, read_only=True).descriptors
        assert described[0].floating_point_range[0].to_value == 1000.0
        gate.touch()
        h.wait_diagnostics(lambda d: d.get(Key.STATE) == "active", 120, "the node to be active")
        assert h.state() == "active"
    finally:
        h.close()
        node.stop_cleanly()
    stages = [d[Key.CONFIGURE_STAGE] for d in h.diagnostics_since(0) if Key.CONFIGURE_STAGE in d]
    order = [STARTING, LOADING, WARMING_UP, SUBSCRIBING]
    assert [s for s in order if s in stages] == list(dict.fromkeys(stages)), stages   # in order, none unknown
    assert f"configuring: {WARMING_UP}" in {d["_message"] for d in h.diagnostics_since(0)}
