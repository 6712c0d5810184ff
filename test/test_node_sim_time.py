"""use_sim_time with a /clock publisher: the control loop, the stamps and the input timeouts
follow simulated time, and a clock that jumps back makes the node hold, say so, and recover.
Also `autostart`: this node is never sent a lifecycle transition."""
import time

import numpy as np
import pytest

from ros_helpers import HOME, Harness, NodeProcess, Robot, assert_ticks_at, command_stamps_ns, jump_back_fits
from vla_node.ros.diagnostics import Key

pytestmark = pytest.mark.timeout(300)

SIM_START_NS = 1000 * 10**9
STEP_NS = 5_000_000          # simulated time per /clock message ...
EVERY_S = 0.01               # ... sent this often: the simulation runs at half speed
# A stamp this close to the harness's sim time is on its timeline: well within the 5 s and 10 s
# jumps back, and far beyond what DDS delays a message by in sim time, however busy the machine.
SAME_TIMELINE_NS = 3 * 10**9


@pytest.fixture(scope="module")
def sim():
    node = NodeProcess({"autostart": True, "use_sim_time": True, "publish_joint_command": True})
    h = Harness(node)
    h.publish_clock(SIM_START_NS)
    h.jumps = []          # ns to set the clock back by, applied by the clock's own timer (no race)
    h.every(EVERY_S, lambda: h.publish_clock(h.sim_time_ns + STEP_NS - (h.jumps.pop() if h.jumps else 0)))
    h.robot = Robot(h)
    try:
        h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "the node to run on simulated time", since=0)
        yield node, h
    finally:
        h.close()
        node.stop()


def test_control_loop_runs_on_simulated_time(sim):
    _, h = sim
    since = time.monotonic()
    h.wait_until(lambda: len(h.messages("joint_command", since)) >= 60, 60, "60 commands")
    # 50 Hz of simulated time, by the stamps the node gave its commands: the simulation runs at
    # half speed (at most: a busy machine delays the clock's messages), which a loop timed on the
    # wall clock would show as ticks 10 ms of sim time apart.
    ticks = command_stamps_ns(h, since)
    assert_ticks_at(0.02, ticks)
    assert abs(ticks[-1] - h.sim_time_ns) < SAME_TIMELINE_NS

    traj = h.wait_until(lambda: h.messages("trajectory", since), 60, "a trajectory")[-1]
    stamp_ns = traj.header.stamp.sec * 10**9 + traj.header.stamp.nanosec
    assert abs(stamp_ns - h.sim_time_ns) < SAME_TIMELINE_NS   # simulated time, not the wall clock
    d = h.wait_diagnostics(lambda d: Key.ms(Key.COMMAND_PERIOD, "p50") in d, 30, "loop statistics")
    assert Key.ms(Key.COMMAND_JITTER, "p99") not in d     # wall-clock jitter means nothing here


def test_clock_jump_back_holds_reports_once_and_recovers(sim):
    node, h = sim
    start = time.monotonic()
    h.jumps.append(10 * 10**9)
    d = h.wait_diagnostics(lambda d: "clock jumped back" in d["_message"], 30, "the jump on /diagnostics",
                           since=start)
    assert d["_level"] == 2 and node.proc.poll() is None
    h.wait_diagnostics(lambda d: d["_message"] == "running", 30, "recovery after the jump")
    node.wait_for_line("resolved: clock: ")
    held = node.wait_for_line("holding: clock: clock jumped back by ")
    assert node.count("holding: clock: clock jumped back by ") == 1
    assert jump_back_fits(held, 10.0, STEP_NS / 1e9), held
    since = time.monotonic()
    traj = h.wait_until(lambda: h.messages("trajectory", since), 60, "a chunk after the jump")[-1]
    stamp_ns = traj.header.stamp.sec * 10**9 + traj.header.stamp.nanosec
    assert abs(stamp_ns - h.sim_time_ns) < SAME_TIMELINE_NS


def test_after_a_jump_back_the_hold_starts_from_the_measured_joints(sim):
    """A restarted simulation puts the robot back at its start: holding the last command of the
    old timeline would drive it back to where the last episode ended."""
    _, h = sim
    h.wait_diagnostics(lambda d: d["_message"] == "running", 30, "the node running")
    restarted = HOME + np.array([0.2, 0.1, 0.0, 0.1, 0.0, -0.1, 0.0, 0.0])
    h.robot.joints = restarted.copy()
    start = time.monotonic()
    h.jumps.append(5 * 10**9)
    h.wait_diagnostics(lambda d: "clock jumped back" in d["_message"], 30, "the jump", since=start)

    def held_at_restart():
        return [m for m in h.messages("command", start) if np.allclose(m.data, restarted, atol=1e-9)]
    h.wait_until(held_at_restart, 30, "a command holding the robot where it was restarted")
    h.robot.joints = HOME.copy()


def test_input_timeout_counts_simulated_time(sim):
    node, h = sim
    h.stop_streams()          # the simulation pauses: nothing is stale while time stands still
    paused = time.monotonic()
    # Diagnostics run on the wall clock: three of them span more than the (simulated) timeout.
    h.wait_until(lambda: len(h.diagnostics_since(paused)) >= 3, 30, "diagnostics while paused")
    assert all("stale" not in d["_message"] for d in h.diagnostics_since(paused))
