"""What the node publishes: from configure to cleanup, the command at every control tick and a
joint trajectory per chunk taken (lifecycle publishers: they go quiet when the node is inactive);
from start-up to the end, /diagnostics.
"""
from __future__ import annotations

import math
import time
from collections import deque
from typing import Callable, Optional

import numpy as np
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.clock import Clock, ClockType
from rclpy.duration import Duration
from rclpy.node import Node
from rclpy.timer import Timer
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from . import messages
from .context import NodeContext
from .diagnostics import RUNNING, Faults, Key, burst_allows, status_pairs, summary


class Outputs:
    """~/command, ~/joint_trajectory and, with publish_joint_command, ~/joint_command."""

    def __init__(self, ctx: NodeContext):
        self._ctx = ctx
        node = self._node = ctx.ros
        self._command = node.create_lifecycle_publisher(Float64MultiArray, "~/command", 10)
        self._trajectory = node.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 10)
        self._joint_command = None
        self.timer: Optional[Timer] = None    # the control timer: trajectories are timed by its ticks
        if ctx.settings.publish_joint_command:
            self._joint_command = node.create_lifecycle_publisher(JointState, "~/joint_command", 10)

    def command(self, command: np.ndarray) -> None:
        self._command.publish(messages.command_msg(command))
        if self._joint_command is not None:
            self._joint_command.publish(messages.joint_command_msg(self._ctx.settings.joint_names, command,
                                                                   self._node.get_clock().now().to_msg()))

    def trajectory(self, commands: np.ndarray) -> None:
        """`commands` [n, joints] for the control ticks of `timer` from its next one on."""
        timer = self.timer
        wait_ns = timer.time_until_next_call() or 0
        first = self._node.get_clock().now() + Duration(nanoseconds=wait_ns)
        self._trajectory.publish(messages.trajectory_msg(self._ctx.settings.joint_names, commands, first.to_msg(),
                                                         timer.timer_period_ns))

    def close(self) -> None:
        for pub in (self._command, self._trajectory, self._joint_command):
            if pub is not None:
                self._node.destroy_lifecycle_publisher(pub)


DIAGNOSTICS_PERIOD_S = 1.0


class ReportPacing:
    """When a report goes out after a control tick (no ROS; `clock` in seconds): once
    DIAGNOSTICS_PERIOD_S has passed since the last report, or at once when the tick commanded (its
    hold is None) while the last report said the node holds, or held while it said "running". So
    /diagnostics says "running" from the first tick the loop commands again (after a fault, after
    an activation's first wait) and "holding" from the first tick it holds for a reason of its own
    (a plan run out), not up to a period later. A new reason to hold (the text of "inference slower
    ..." changes every tick) is no change, nor is a hold that a fault's announcement (Faults'
    on_change) has reported already (unless a tick runs before that announcement is published:
    one report more).

    Changes are announced at most LOG_BURST times in any LOG_WINDOW_S, as a fault source's changes
    are (diagnostics.Faults); beyond that the periodic report says where the loop stands, so a loop
    that alternates holding and commanding every tick is reported near the period, not at the tick
    rate. The budget is their own, like one more fault source's, not one shared with the faults:
    test_node_malformed's cases, a fault that starts and ends every 0.6 s, would leave a shared one
    nothing for the returns to "running" from the fourth case on."""

    def __init__(self, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._sent = -math.inf      # clock() of the last report
        self._running = False       # whether it said the node runs (RUNNING)
        self._announced: deque = deque()   # clock() of the changes announced in the last LOG_WINDOW_S

    def due(self, commanding: Optional[bool] = None) -> bool:
        """Report now? `commanding`: whether the tick just run commanded; None: no tick (configure's
        waits), only the period counts. True for a change is counted against its budget."""
        now = self._clock()
        if now - self._sent >= DIAGNOSTICS_PERIOD_S:
            return True
        return commanding is not None and commanding != self._running and burst_allows(self._announced, now)

    def sent(self, running: bool) -> None:
        """A report went out (whatever made it), saying the node runs or not."""
        self._sent, self._running = self._clock(), running


class DiagnosticsPublisher:
    """/diagnostics with `status()` = (level, message, values): right after a control tick once a
    period has passed or when the loop started or stopped commanding (ReportPacing; building a
    report takes a few milliseconds: there it cannot delay a tick), when `on_period` publishes (its
    timer runs on wall time: diagnostics keep coming while a simulation is paused), and at once on
    now() (a fault that starts or ends: Faults limits how often)."""

    def __init__(self, node: Node, status: Callable[[], tuple[int, str, list]], on_period: Callable[[], None]):
        self._node, self._status = node, status
        self._pub = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # now() may be called on the decoder thread: the guard condition publishes from the executor.
        self._now = node.create_guard_condition(self.publish)
        node.create_timer(DIAGNOSTICS_PERIOD_S, on_period, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self._pacing = ReportPacing()

    def now(self) -> None:
        self._now.trigger()

    def after_tick(self, commanding: Optional[bool] = None) -> None:
        """After a control tick (`commanding`: its hold is None), or between looks at configure's
        progress (None): a report if ReportPacing says one is due."""
        if self._pacing.due(commanding):
            self.publish()

    def when_idle(self, faults: Faults, telemetry) -> None:
        """Diagnostics when no control tick sends them (inactive, or a paused simulation)."""
        faults.flush()
        newest = telemetry.loop.newest()
        if newest is None or time.perf_counter() - newest > 0.5:
            self.publish()

    def publish(self) -> None:
        level, message, values = self._status()
        self._pub.publish(messages.diagnostics_msg("vla_node: policy", self._node.get_fully_qualified_name(), level,
                                                   message, values, self._node.get_clock().now().to_msg()))
        self._pacing.sent(message == RUNNING)


def node_status(state: str, stage: str, configure_error: str, faults: Faults, control, parts, telemetry, settings,
                sim_time: bool, now_ns: int) -> tuple[int, str, list]:
    """/diagnostics of the node: level, message and values. `control` (control.ChunkScheduler) and
    `parts` (the engine link and the inputs) may be None: not configured (yet)."""
    active = faults.active()
    hold = control.state.hold if control is not None else "inactive"
    level, message = summary(state, configure_error, active, hold, stage)
    values = status_pairs(state, configure_error, active, hold, faults.events, stage)
    engine, inputs = parts
    if engine is not None:
        values += engine.pairs()
    values.append((Key.CONTROL_RATE_HZ, settings.control_rate_hz))
    if control is not None:
        values += control.pairs()
    values += telemetry.pairs(settings.control_period_s, sim_time, settings.engine.device)
    if inputs is not None:
        values += inputs.pairs(now_ns)
    return level, message, values
