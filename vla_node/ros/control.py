"""Chunk execution: the chunk scheduler (which action runs at each control tick, when to ask
for the next chunk, which answers to take), the plan, the hand-over from the executing chunk to a
new one, the checkpoint's post-processing and the safety filter every command passes through.
No ROS here: the node and the simulator's closed loop (vla-sim eval) both run ChunkScheduler.

Ticks are counted by the control loop. A request sent after tick d gets a chunk whose action i
is meant for tick d + 1 + i; when it arrives after tick r, ticks up to r have already run. With a
fixed latency (the node's fixed_latency_s, vla-sim eval's --latency-ms) it arrives after tick
d + latency_ticks(latency_s, period_s), whenever the engine really finished: the loop is then the
same on any machine.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from ..runtime.windows import Wait
from .diagnostics import FaultSource, Key

LATENCY_WINDOW = 10     # recent inference latencies (in ticks) whose maximum is the rtc freeze
# How a new chunk takes over from the plan (Plan.hand_over): rtc and inpaint keep the actions that
# run while it is inferred; inpaint has the model generate the chunk from them (runtime
# KnownActions), so nothing needs blending.
HANDOVER_MODES = ("rtc", "average", "inpaint")
# Fault sources the engine's next answer or the next observation sent clears: observations keep
# being sent while they are active.
RETRY_SOURCES = {FaultSource.ENGINE, FaultSource.OUTPUT, FaultSource.SYNC, FaultSource.CLOCK, FaultSource.TIMELINE}


def latency_ticks(latency_s: float, period_s: float) -> int:
    """An inference latency in control ticks: a request sent after tick d is answered at tick
    d + latency_ticks, the first tick at least latency_s after it (never before the next one)."""
    return max(1, math.ceil(latency_s / period_s - 1e-9))


def blocking_cause(faults: set[str], instruction: str) -> Optional[str]:
    """What stops the plan from running (ChunkScheduler.next_tick): the fault sources, or no
    instruction; None if nothing does."""
    if faults:
        return ", ".join(sorted(faults))
    return None if instruction.strip() else "no instruction"


def may_send(faults: set[str], instruction: str) -> bool:
    """Whether an observation may go to the engine: an instruction, and only faults that the
    engine's answer or the observation itself clears (RETRY_SOURCES)."""
    return not faults - RETRY_SOURCES and bool(instruction.strip())


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
        inpaint: as rtc without the fade: the chunk was generated from those kept actions (its
        request's known prefix, `freeze` of them), so it continues them as it is.
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
            if mode == "average":
                w_old = np.full(len(old_rows), 1.0 - weight)
            else:
                since = ticks[has_old] - (first_tick + freeze)    # < 0: frozen
                fade = blend_steps if mode == "rtc" else 0        # 0: weights 1 then 0, the rows exactly
                w_old = np.clip(1.0 - (since + 1) / (fade + 1), 0.0, 1.0)
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

    @classmethod
    def of(cls, limits: "SafetyLimits") -> "SafetyFilter":
        return cls(limits.joint_lower_limits, limits.joint_upper_limits, limits.max_step_per_tick)

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


class SafetyLimits(Protocol):
    """The parameters of the safety filter (vla_node.ros.params.Settings; the simulator's
    ControlSettings), per joint."""
    joint_lower_limits: Sequence[float]
    joint_upper_limits: Sequence[float]
    max_step_per_tick: Sequence[float]


class ControlParams(Protocol):
    """The parameters the scheduler follows (vla_node.ros.params.Settings; the simulator's
    ControlSettings): read at every decision, so a change applies from the next tick."""
    replan_threshold: int
    handover: str
    blend_steps: int
    average_weight: float


@dataclass
class Request:
    """An observation sent to the engine: its chunk's action i is meant for tick `tick` + 1 + i."""
    id: int
    tick: int                   # the tick after which it was sent
    epoch: int                  # the control state's epoch then: a chunk of an older one is stale
    window: Any = None          # what was sent (the node's frames.Window)
    late_ticks: int = 0         # ticks it was sent after it was due ...
    late_because: str = ""      # ... and why (the inputs it waited for)
    due_tick: Optional[int] = None   # a fixed latency: its answer is taken at this tick, not before
    # inpaint: the plan's actions for ticks tick + 1 ... that run while it is inferred (robot
    # units, as planned): its chunk is generated to start with them. None: nothing sent.
    known_actions: Optional[np.ndarray] = None
    sent_at: float = 0.0        # time.perf_counter() once sent (telemetry)
    send_ms: float = 0.0        # node time spent choosing the window and sending it


@dataclass
class ControlState:
    """What the control loop carries from tick to tick. A reset is one assignment with the next
    epoch: the answer to a request sent before it is stale."""
    epoch: int = 0
    tick: int = 0                           # ticks since the reset; the first is 1
    plan: Plan = field(default_factory=Plan)
    last_command: Optional[np.ndarray] = None
    in_flight: Optional[Request] = None
    blocked: Optional[str] = None           # what stops the plan: fault sources, no instruction
    hold: Optional[str] = "inactive"        # why this tick commanded no planned action; None: it did
    latency_ticks: deque = field(default_factory=lambda: deque(maxlen=LATENCY_WINDOW))
    wait: Optional[Wait] = None             # why the observation due could not be sent
    due_since: Optional[int] = None         # tick since which an observation is due but waits


# What take() did with a chunk.
TAKEN = "taken"             # in the plan from the next tick on
LATE = "late"               # arrived after its last action's tick: nothing of it could run
STALE = "stale"             # its request is from before a reset, a hold or a new timeline
NON_FINITE = "non-finite"   # NaN or inf among its actions: dropped


class ChunkScheduler:
    """The control loop's decisions, tick by tick, without ROS or an engine:

        target, ran_out = next_tick(blocked)    the plan's action for this tick (None: hold)
        command(target, measured)               the command to publish (post-processed, safe)
        wants_observation()                     ask for the next chunk now?
        waiting(wait) / request(window) / sent(request)   it could not go / it goes
        answer_held_back() / due_request()      a fixed latency: not yet / now, wait for it
        answered(request_id) -> take(request, actions)    TAKEN | LATE | STALE | NON_FINITE

    One request is in flight at a time. A new block (a fault, no instruction), a reset and a
    new timeline each start a new epoch: a chunk computed before it must not resume the plan.
    The rtc freeze is the largest inference latency (in ticks) of the last LATENCY_WINDOW
    chunks; in inpaint mode a request carries that many planned actions as its chunk's known
    prefix. `params` (ControlParams), `safety` and `post` may be replaced at any time.
    """

    def __init__(self, params: ControlParams, safety: SafetyFilter, post: Optional[PostProcess] = None):
        self.params, self.safety, self.post = params, safety, post or PostProcess()
        self.state = ControlState()
        self._next_id = 0       # never reset: an answer is matched to its request by id

    def reset(self) -> None:
        """Start over (activation, deactivation, cleanup): no plan, no last command, nothing in
        flight; whatever answers a request sent before is stale."""
        self.state = ControlState(epoch=self.state.epoch + 1)

    def hold(self, reason: str) -> None:
        """Why the ticks hold until the next one says otherwise (an activation's first wait)."""
        self.state.hold = reason

    def drop_plan(self) -> None:
        """Forget the plan and the chunk in flight (a new timeline, a hold); the request stays in
        flight until answered, and its answer is stale."""
        self.state.plan.clear()
        self.state.epoch += 1

    # -- each tick ------------------------------------------------------------------------------
    def next_tick(self, blocked: Optional[str]) -> tuple[Optional[np.ndarray], bool]:
        """Advance one tick: (the plan's action for it or None to hold, whether the plan ran out
        before the next chunk). `blocked`: what stops the plan, None if nothing; a new block
        drops the plan and the chunk in flight."""
        c = self.state
        c.tick += 1
        if blocked is not None and c.blocked is None:
            self.drop_plan()
        c.blocked = blocked
        target = None if blocked else c.plan.action(c.tick)
        ran_out = target is None and not blocked and c.plan.actions is not None
        if ran_out:
            c.plan.clear()
        c.hold = blocked or (None if target is not None else c.wait.reason if c.wait else "waiting for a chunk")
        return target, ran_out

    def command(self, target: Optional[np.ndarray], measured: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """The command for this tick: `target` post-processed against the measured joints, or the
        last command held (the measured joints before the first), through the safety filter.
        None when there is neither a last command nor a measurement: anything would be a guess."""
        previous = self.state.last_command if self.state.last_command is not None else measured
        if previous is None:
            return None
        if target is not None:
            target = self.post.command(target, measured)
        self.state.last_command = self.safety(previous if target is None else target, previous)
        return self.state.last_command

    def upcoming_commands(self, measured: Optional[np.ndarray]) -> Optional[np.ndarray]:
        """[n, joints] the commands the plan would give at the ticks after this one, as command()
        would make them (the trajectory published with each chunk); None without a plan."""
        actions = self.state.plan.upcoming(self.state.tick)
        if actions is None:
            return None
        return self.safety.rollout(np.array([self.post.command(a, measured) for a in actions]), self.state.last_command)

    def underrun_cause(self) -> str:
        """Why the next chunk is not here (when the plan ran out): the inputs an observation
        waited for, or inference."""
        c = self.state
        request = c.in_flight
        if request is None:
            return f"no observation could be sent: {c.wait.reason}" if c.wait else \
                "no observation was sent since the last chunk"
        if request.late_ticks:
            return f"its observation was sent {request.late_ticks} ticks late: {request.late_because}"
        return f"inference slower than replan_threshold ticks allow (in flight for {c.tick - request.tick} ticks)"

    def pairs(self) -> list[tuple[str, object]]:
        """/diagnostics values: ticks since the reset and the rtc freeze in effect."""
        c = self.state
        values: list[tuple[str, object]] = [(Key.TICKS, c.tick)]
        if c.latency_ticks:
            values.append((Key.LATENCY_TICKS_MAX, max(c.latency_ticks)))
        return values

    # -- requests -------------------------------------------------------------------------------
    def wants_observation(self) -> bool:
        """Nothing in flight and at most replan_threshold planned actions left."""
        c = self.state
        return c.in_flight is None and c.plan.remaining(c.tick) <= self.params.replan_threshold

    def waiting(self, wait: Optional[Wait]) -> None:
        """An observation is due but cannot go: the inputs are not ready (`wait`: why; the ticks
        from now on count as the request's lateness), or None: a fault holds requests too (its
        ticks are not the inputs' fault)."""
        c = self.state
        if wait is None:
            c.due_since = None
            return
        c.wait = wait
        if c.due_since is None:
            c.due_since = c.tick

    def request(self, window: Any = None) -> Request:
        """The request for `window`, sent after this tick; hand it to sent() once it went out."""
        c = self.state
        late = c.tick - c.due_since if c.due_since is not None else 0
        request = Request(self._next_id, c.tick, c.epoch, window, late, c.wait.reason if late and c.wait else "",
                          known_actions=self._known_prefix())
        self._next_id += 1
        c.wait = c.due_since = None
        return request

    def _known_prefix(self) -> Optional[np.ndarray]:
        """inpaint: the planned actions [k, joints] for the ticks after this one that will run
        while the chunk asked for now is inferred, k being the rtc freeze (the largest recent
        latency in ticks) or fewer where the plan ends; None in other modes or with nothing planned."""
        c = self.state
        upcoming = c.plan.upcoming(c.tick)
        if self.params.handover != "inpaint" or upcoming is None or not c.latency_ticks:
            return None
        return upcoming[:max(c.latency_ticks)].astype(np.float32)

    def sent(self, request: Request, fixed_latency_ticks: Optional[int] = None) -> None:
        """`request` went out. With `fixed_latency_ticks`, its answer is taken at tick
        request.tick + fixed_latency_ticks exactly: held back before it, waited for at it."""
        if fixed_latency_ticks is not None:
            request.due_tick = request.tick + fixed_latency_ticks
        self.state.in_flight = request

    def engine_lost(self) -> None:
        """The engine is gone, and the request in flight with it: nothing is waited for."""
        self.state.in_flight = None

    # -- answers ---------------------------------------------------------------------------------
    def answer_held_back(self) -> bool:
        """The request in flight has a fixed latency that has not passed yet: an answer that is
        already there waits until its due tick."""
        request = self.state.in_flight
        return request is not None and request.due_tick is not None and self.state.tick < request.due_tick

    def due_request(self) -> Optional[Request]:
        """The request in flight if a fixed latency makes its answer due now: this tick takes it,
        however long the engine takes; else None."""
        request = self.state.in_flight
        if request is not None and request.due_tick is not None and self.state.tick >= request.due_tick:
            return request
        return None

    def answer_overdue(self) -> None:
        """The engine did not answer at the due tick within the wait allowed: stop waiting for it
        (its answer, if it comes, is taken whenever it arrives; the fault's hold makes it stale)."""
        if self.state.in_flight is not None:
            self.state.in_flight.due_tick = None

    def answered(self, request_id: int) -> Optional[Request]:
        """The request in flight, if this answers it (it is no longer in flight then); None for
        the answer to a request forgotten by a reset or the loss of the engine."""
        c = self.state
        if c.in_flight is None or c.in_flight.id != request_id:
            return None
        request, c.in_flight = c.in_flight, None
        return request

    def take(self, request: Optional[Request], actions: np.ndarray) -> str:
        """Hand the chunk [horizon, joints] of `request` (answered()) over into the plan."""
        c, p = self.state, self.params
        if request is None or request.epoch != c.epoch:
            return STALE
        if not np.all(np.isfinite(actions)):
            return NON_FINITE
        c.latency_ticks.append(c.tick - request.tick)
        freeze = max(c.latency_ticks)
        if p.handover == "inpaint":   # the chunk continues what was sent with its request
            freeze = 0 if request.known_actions is None else len(request.known_actions)
        taken = c.plan.hand_over(self.post.chunk(actions), request.tick + 1, c.tick, p.handover, freeze,
                                 p.blend_steps, p.average_weight)
        return TAKEN if taken else LATE
