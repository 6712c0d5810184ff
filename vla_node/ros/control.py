"""Chunk execution: the plan (one action per control tick), the hand-over from the executing
chunk to a new one, and the safety filter every command passes through. No ROS here.

Ticks are counted by the control loop. A request sent after tick d gets a chunk whose action i
is meant for tick d + 1 + i; when it arrives after tick r, ticks up to r have already run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

LATENCY_WINDOW = 10     # recent inference latencies (in ticks) whose maximum is the rtc freeze


class Plan:
    def __init__(self):
        self.start = 0                      # tick of actions[0]
        self.actions: Optional[np.ndarray] = None

    def clear(self) -> None:
        self.actions = None

    def action(self, tick: int) -> Optional[np.ndarray]:
        if self.actions is None or not self.start <= tick < self.start + len(self.actions):
            return None
        return self.actions[tick - self.start]

    def remaining(self, tick: int) -> int:
        """Planned actions after `tick`."""
        if self.actions is None:
            return 0
        return max(0, self.start + len(self.actions) - 1 - tick)

    def upcoming(self, tick: int) -> Optional[np.ndarray]:
        """The actions planned after `tick`."""
        if self.remaining(tick) == 0:
            return None
        return self.actions[tick + 1 - self.start:]

    def hand_over(self, chunk: np.ndarray, first_tick: int, now_tick: int, mode: str, freeze: int,
                  blend_steps: int, weight: float) -> bool:
        """Replace the plan from tick now_tick + 1 on by `chunk` (action i for tick first_tick + i).
        False when the whole chunk lies in the past (it arrived after its last action's tick): the
        old plan stays.

        rtc: the old plan's actions for ticks before first_tick + freeze are kept (they execute
        while the chunk is computed: `freeze` is the inference latency in ticks), then the old
        plan fades out linearly over `blend_steps` ticks; the new chunk alone after that.
        average: over the overlap, (1 - weight) * old + weight * new.
        """
        ticks = np.arange(max(first_tick, now_tick + 1), first_tick + len(chunk))
        if len(ticks) == 0:
            return False
        new = chunk[ticks - first_tick].astype(np.float64)
        old, old_start = self.actions, self.start
        if old is None:
            has_old = np.zeros(len(ticks), dtype=bool)
        else:
            has_old = (ticks >= old_start) & (ticks < old_start + len(old))
        if has_old.any():
            old_rows = old[ticks[has_old] - old_start]
            if mode == "rtc":
                since = ticks[has_old] - (first_tick + freeze)    # < 0: frozen
                w_old = np.clip(1.0 - (since + 1) / (blend_steps + 1), 0.0, 1.0)
            else:
                w_old = np.full(len(old_rows), 1.0 - weight)
            new[has_old] = w_old[:, None] * old_rows + (1.0 - w_old[:, None]) * new[has_old]
        self.start = int(ticks[0])
        self.actions = new
        return True


@dataclass(frozen=True)
class PostProcess:
    """The official deployment's action post-processing, from the checkpoint's RobotConfig
    (MolmoBot's real-robot configs): gripper channels binarised at a threshold; relative arm
    actions added to the measured joints; and the arm's move from the measured joints scaled
    down as a whole (its direction kept) so that no joint moves more than max_joint_delta. Off
    (all empty) for checkpoints that record none. The node's SafetyFilter runs after it."""
    gripper_dims: tuple[int, ...] = ()
    gripper_threshold: Optional[float] = None
    gripper_values: tuple[float, float] = (0.0, 1.0)
    relative_dims: int = 0
    max_joint_delta: tuple[float, ...] = ()

    @classmethod
    def of(cls, robot: dict, delta_scale: float = 1.0) -> "PostProcess":
        relative = robot.get("relative_dims", 0) if robot.get("action_type") == "relative" else 0
        return cls(tuple(robot.get("gripper_dims", ())), robot.get("gripper_threshold"),
                   tuple(robot.get("gripper_values", (0.0, 1.0))), relative,
                   tuple(delta_scale * d for d in robot.get("max_joint_delta", ())))

    def chunk(self, actions: np.ndarray) -> np.ndarray:
        """A chunk [H, A] as it arrives: the gripper channels binarised (`value > threshold`)."""
        if self.gripper_threshold is None or not self.gripper_dims:
            return actions
        out = actions.copy()
        low, high = self.gripper_values
        dims = list(self.gripper_dims)
        out[:, dims] = np.where(out[:, dims] > self.gripper_threshold, high, low)
        return out

    def command(self, target: np.ndarray, measured: Optional[np.ndarray]) -> np.ndarray:
        """One tick's action [A] against the measured joints [state_dim] (joint_names order)."""
        if measured is None or not (self.relative_dims or self.max_joint_delta):
            return target
        out = target.astype(np.float64, copy=True)
        if self.relative_dims:
            out[:self.relative_dims] += measured[:self.relative_dims]
        n = len(self.max_joint_delta)
        if n:
            delta = out[:n] - measured[:n]
            worst = float(np.max(np.abs(delta) / np.asarray(self.max_joint_delta)))
            if worst > 1:
                out[:n] = measured[:n] + delta / worst
        return out


class SafetyFilter:
    """Joint limits, then a maximum step per tick from the previous command. The step limit has
    the last word: a command outside newly tightened limits moves into them at max_step per
    tick instead of jumping."""

    def __init__(self, lower, upper, max_step):
        self.lower = np.asarray(lower, dtype=np.float64)
        self.upper = np.asarray(upper, dtype=np.float64)
        self.max_step = np.asarray(max_step, dtype=np.float64)

    def __call__(self, target: np.ndarray, previous: Optional[np.ndarray]) -> np.ndarray:
        command = np.clip(target, self.lower, self.upper)
        if previous is not None:
            command = np.clip(command, previous - self.max_step, previous + self.max_step)
        return command

    def rollout(self, targets: np.ndarray, previous: Optional[np.ndarray]) -> np.ndarray:
        """The commands a sequence of targets would produce, tick after tick (in place, without
        np.clip's overhead: this runs on the control thread for every chunk)."""
        out = np.minimum(np.maximum(targets, self.lower), self.upper).astype(np.float64)
        for row in out:
            if previous is not None:
                np.maximum(row, previous - self.max_step, out=row)
                np.minimum(row, previous + self.max_step, out=row)
            previous = row
        return out
