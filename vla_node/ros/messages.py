"""Arrays -> ROS messages: commands, trajectories and diagnostic values out. (Inputs are converted by code the bag
reader shares: camera images in vla_node/runtime/images.py, joint states in runtime/windows.py.)
"""
from __future__ import annotations

import array
from typing import Iterable, Sequence

import numpy as np
from builtin_interfaces.msg import Duration as DurationMsg
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory, JointTrajectoryPoint


def stamp_ns(stamp) -> int:
    return stamp.sec * 1_000_000_000 + stamp.nanosec


def command_msg(command: np.ndarray) -> Float64MultiArray:
    return Float64MultiArray(data=command.tolist())


def joint_command_msg(names: Sequence[str], command: np.ndarray, stamp) -> JointState:
    msg = JointState(name=list(names), position=command.tolist())
    msg.header.stamp = stamp
    return msg


def trajectory_msg(names: Sequence[str], positions: np.ndarray, stamp, period_ns: int) -> JointTrajectory:
    """One point per control tick; the header stamp is when the first point executes."""
    msg = JointTrajectory(joint_names=list(names))
    msg.header.stamp = stamp
    points = []
    for i, q in enumerate(positions.astype(np.float64)):
        t = i * period_ns
        # array('d') is rclpy's fast path for float64[] (a list is checked value by value).
        points.append(JointTrajectoryPoint(positions=array.array("d", q.tobytes()),
                                           time_from_start=DurationMsg(sec=t // 1_000_000_000,
                                                                       nanosec=t % 1_000_000_000)))
    msg.points = points
    return msg


def diagnostics_msg(name: str, hardware_id: str, level: int, message: str, pairs: Iterable[tuple[str, object]],
                    stamp) -> DiagnosticArray:
    """One status; its values' floats with 3 decimals, everything else as str()."""
    values = [KeyValue(key=k, value=f"{v:.3f}" if isinstance(v, float) else str(v)) for k, v in pairs]
    status = DiagnosticStatus(level=bytes([level]), name=name, message=message, hardware_id=hardware_id,
                              values=values)
    msg = DiagnosticArray(status=[status])
    msg.header.stamp = stamp
    return msg
