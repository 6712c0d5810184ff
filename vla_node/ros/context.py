"""What the node's parts (inputs.Inputs, engine_link.EngineLink, outputs.Outputs) get from the
node: the rclpy node they create their subscriptions, publishers and timers on, the current
settings, the faults, the telemetry, the clock and the logger. Not the VLANode itself: the parts
neither reach into it nor import it (no import circle in ros/).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rclpy.node import Node

from .diagnostics import Faults, NodeTelemetry
from .params import Settings


@dataclass
class NodeContext:
    ros: Node                                # creates and destroys the parts' ROS entities
    faults: Faults
    telemetry: NodeTelemetry
    current_settings: Callable[[], Settings]  # the node replaces its settings on every parameter change

    @property
    def settings(self) -> Settings:
        return self.current_settings()

    @property
    def logger(self):
        return self.ros.get_logger()

    def now_ns(self) -> int:
        """The node's clock (simulated with use_sim_time)."""
        return self.ros.get_clock().now().nanoseconds
