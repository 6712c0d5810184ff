"""What the node publishes: from configure to cleanup, the command at every control tick and a
joint trajectory per chunk taken (lifecycle publishers: they go quiet when the node is inactive);
from start-up to the end, /diagnostics.
"""
from __future__ import annotations

import time
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
from .diagnostics import Faults, Key, status_pairs, summary


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


class DiagnosticsPublisher:
    """/diagnostics with `status()` = (level, message, values): right after a control tick once a
    period has passed (building it takes a few milliseconds: there it cannot delay a tick), when
    `on_period` publishes (its timer runs on wall time: diagnostics keep coming while a
    simulation is paused), and at once on now()."""

    def __init__(self, node: Node, status: Callable[[], tuple[int, str, list]], on_period: Callable[[], None]):
        self._node, self._status = node, status
        self._pub = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # now() may be called on the decoder thread: the guard condition publishes from the executor.
        self._now = node.create_guard_condition(self.publish)
        node.create_timer(DIAGNOSTICS_PERIOD_S, on_period, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self._sent = 0.0    # time.monotonic() of the last message

    def now(self) -> None:
        self._now.trigger()

    def after_tick(self) -> None:
        if time.monotonic() - self._sent >= DIAGNOSTICS_PERIOD_S:
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
        self._sent = time.monotonic()


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
