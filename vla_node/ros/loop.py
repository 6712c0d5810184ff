"""One control tick, in the one order the node (its control timer) and the simulator's closed loop
(vla-sim eval) both run. No ROS here.

    next_tick -> command -> answered -> take -> wants_observation -> request -> sent

ControlLoop.tick(now_ns) applies control.ChunkScheduler's decisions through three narrow ports:
the engine (submit an observation, poll for its answer), the inputs (their health, the newest
complete window, the measured joints) and a sink (the command of every tick, a trajectory per
chunk taken). The node's ports are engine_link.EngineLink, inputs.Inputs and outputs.Outputs; the
simulator's are a latency-model engine (answers due a fixed number of ticks after the request, in
sim time) and the frames it renders. So a stale chunk (its request from before a hold or a new
timeline) is discarded and a chunk with non-finite actions holds ("output") in both.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import numpy as np

from ..runtime.windows import Wait
from .control import LATE, NON_FINITE, STALE, ChunkScheduler, Request, blocking_cause, may_send
from .diagnostics import Faults, FaultSource, Key, NodeTelemetry, duration_in_words
from .engine_protocol import Answer, Chunk


class EnginePort(Protocol):
    serving: bool     # a worker is there to answer

    # known_actions: the request's (control.Request.known_actions): its chunk's first actions
    def submit(self, request_id: int, window: Any, instruction: str,
               known_actions: Optional[np.ndarray]) -> bool: ...
    def poll(self) -> Optional[Answer]: ...                       # never blocks
    def wait(self, request_id: int) -> Optional[Answer]: ...      # the answer a fixed latency makes due now
    def latency_ticks(self, request: Request) -> Optional[int]: ...   # fixed latency of a request sent; None: none
    def reset_stream(self) -> None: ...


class InputPort(Protocol):
    def check(self, now_ns: int) -> bool: ...    # input health (faults); True: the timeline changed since
    def take_window(self, now_ns: int) -> Any: ...   # the newest complete window, or a Wait
    def not_sending(self) -> None: ...           # a fault holds observations: being out of step is not timed
    def measured(self) -> Optional[np.ndarray]: ...   # [joints] the newest joint positions; None: not all yet
    def release_window(self) -> None: ...        # the window sent last was answered or lost


class Sink(Protocol):
    def command(self, command: np.ndarray) -> None: ...
    def trajectory(self, commands: Optional[np.ndarray]) -> None: ...   # [n, joints] for the ticks after this one


class Settings(Protocol):
    instruction: str


@dataclass
class Tick:
    """What one tick did (the simulator's statistics read it)."""
    target: Optional[np.ndarray]            # the plan's action; None: held
    command: Optional[np.ndarray]           # what the sink got; None: nothing known to command yet
    ran_out: bool = False
    answered: Optional[Request] = None      # the request whose answer this tick took ...
    outcome: str = ""                       # ... and what became of it (control.TAKEN, LATE, STALE, NON_FINITE)
    sent: Optional[Request] = None          # the request sent after this tick


class _Quiet:
    """A logger that says nothing (the simulator's loop)."""

    def warning(self, message: str, **_) -> None:
        pass

    info = error = debug = warning


QUIET = _Quiet()


class ControlLoop:
    """The order of one control tick; every decision is `control`'s. Faults go to `faults`, counts
    and timings to `telemetry`, warnings to `logger` (an rclpy logger, or none)."""

    def __init__(self, control: ChunkScheduler, engine: EnginePort, inputs: InputPort, sink: Sink, faults: Faults,
                 telemetry: NodeTelemetry, settings: Callable[[], Settings], logger=None):
        self.control, self.engine, self.inputs, self.sink = control, engine, inputs, sink
        self.faults, self.telemetry, self._settings = faults, telemetry, settings
        self._logger = logger if logger is not None else QUIET

    def tick(self, now_ns: int) -> Tick:
        started = time.perf_counter()
        control, s = self.control, self._settings()
        if self.inputs.check(now_ns):
            self.new_timeline()
        target, ran_out = control.next_tick(blocking_cause(self.faults.sources(), s.instruction))
        tick = Tick(target, control.command(target, self.inputs.measured()), ran_out)
        if tick.command is not None:     # None: not every joint known yet, anything would be a guess
            self.sink.command(tick.command)
        self.telemetry.tick(started)
        if ran_out:
            self.telemetry.counts[Key.PLAN_UNDERRUNS] += 1
            self._logger.warning(f"plan ran out before the next chunk: {control.underrun_cause()}",
                                 throttle_duration_sec=5.0)
        self._collect(tick)
        self._dispatch(now_ns, tick)
        return tick

    def new_timeline(self) -> None:
        """The inputs' timeline changed: forget the plan, drop the chunk in flight, and the
        engine's stream state (a frame of the new timeline may carry a stamp it has cached another
        picture under)."""
        self.engine.reset_stream()
        self.control.drop_plan()

    def engine_lost(self) -> None:
        """The engine's worker is gone, and the request in flight with it."""
        self.control.engine_lost()
        self.inputs.release_window()

    def engine_restarted(self) -> None:
        """A new worker serves: nothing sent to the old one is waited for."""
        self.telemetry.counts[Key.ENGINE_RESTARTS] += 1
        self.control.drop_plan()

    def _collect(self, tick: Tick) -> None:
        """Take the engine's answer, if there is one; with a fixed latency, at its due tick only,
        waiting for it then."""
        control = self.control
        if control.answer_held_back():
            return
        due = control.due_request()
        result = self.engine.poll() if due is None else self.engine.wait(due.id)
        arrived = time.perf_counter()
        if result is None:
            if due is not None:
                control.answer_overdue()
            return
        request = tick.answered = control.answered(result.request_id)
        if request is not None:
            self.inputs.release_window()
        if not isinstance(result, Chunk):
            return      # rejected or failed: the engine port reported it
        tick.outcome = outcome = control.take(request, result.actions)
        if outcome == STALE:
            self.telemetry.counts[Key.DISCARDED] += 1
            return
        if outcome == NON_FINITE:
            self.faults.set(FaultSource.OUTPUT, "the chunk has non-finite actions; dropped")
            return
        self.faults.clear(FaultSource.ENGINE)
        self.faults.clear(FaultSource.OUTPUT)
        self.telemetry.chunk(request, result, arrived)   # the control loop has the chunk (or dropped it)
        if outcome == LATE:
            self.telemetry.counts[Key.LATE_CHUNKS] += 1
            self._logger.warning(f"chunk arrived {control.state.tick - request.tick} ticks after its request, after "
                                 "its last action: dropped (inference slower than the horizon)",
                                 throttle_duration_sec=5.0)
            return
        t0 = time.perf_counter()
        # The plan's relative moves, against the joints measured now.
        self.sink.trajectory(control.upcoming_commands(self.inputs.measured()))
        self.telemetry.trajectory_ms.add((time.perf_counter() - t0) * 1e3)
        self.telemetry.counts[Key.CHUNKS] += 1

    def _dispatch(self, now_ns: int, tick: Tick) -> None:
        """Send the newest complete observation when the plan runs low and nothing is in flight."""
        control, s = self.control, self._settings()
        if not self.engine.serving or not control.wants_observation():
            return
        if not may_send(self.faults.sources(), s.instruction):
            control.waiting(None)
            self.inputs.not_sending()
            return
        t0 = time.perf_counter()
        window = self.inputs.take_window(now_ns)
        if isinstance(window, Wait):
            control.waiting(window)
            return
        request = control.request(window)
        if not self.engine.submit(request.id, window, s.instruction.strip(), request.known_actions):
            return
        request.sent_at = time.perf_counter()
        request.send_ms = (request.sent_at - t0) * 1e3
        control.sent(request, self.engine.latency_ticks(request))
        tick.sent = request
        self.telemetry.counts[Key.REQUESTS] += 1


CLOCK_JUMPED_BACK = "clock jumped back"   # the hold's reason, which /diagnostics carries (vla-sim run waits for it)


def clock_jumped_back(back_s: float, control: ChunkScheduler, faults: Faults, inputs=None, engine=None) -> None:
    """Time went backwards (a restarted simulation or bag): every stored stamp is from the future
    now. Forget the frames, the joints and the engine's stream state (`inputs`, `engine`: None
    before configure), and start the control loop over as an activation does (a reset: no plan, no
    last command, nothing in flight waited for); the next complete window clears the fault."""
    if inputs is not None:
        inputs.forget()
    if engine is not None:
        engine.reset_stream()
    # A restarted simulation has moved the robot: the hold restarts from its next measured
    # position, not from the last command of the old timeline (stamps stepping back without
    # a clock jump keep it: every command stays within max_step_per_tick). Its first request
    # goes out at once, as after an activation, so an episode runs the same whatever the last
    # one left in flight (the engine answers that one first: stale, dropped).
    control.reset()
    faults.set(FaultSource.CLOCK, f"{CLOCK_JUMPED_BACK} by {duration_in_words(back_s)}; inputs and plan discarded")
