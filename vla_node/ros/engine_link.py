"""The node's side of the engine process, from configure to cleanup: starting it, sending
observations and taking answers, the run-time engine options (Reconfigure: the engine's answer is
the configuration the node mirrors), and the loss of its worker
with the restart that engine_restart_s asks for. The process itself, and what crosses its
boundary, are engine_process.py and engine_protocol.py (no ROS there: the worker imports them).
"""
from __future__ import annotations

import time
from typing import Callable, Optional

import numpy as np
from rclpy.clock import Clock, ClockType
from rclpy.logging import LoggingSeverity
from rclpy.parameter import Parameter

from ..runtime.types import RUNTIME_OPTIONS, EngineConfig
from . import params
from .context import NodeContext
from .control import PostProcess
from .diagnostics import FaultSource, Key
from .engine_process import EngineError, EngineInfo, EngineProcess
from .engine_protocol import Answer, Failed, Predict, Reconfigured, Rejected, WorkerOptions
from .frames import Window

RESTART_POLL_S = 0.1    # how often a restarting engine is checked (on the executor, never blocking)
# fixed_latency_s: how long the tick a chunk is due at waits for the engine. Far beyond any
# inference the node runs, and short of vla-sim's lockstep timeout (120 s), so that the node's
# fault, not the simulator's, says what happened.
FIXED_LATENCY_WAIT_S = 60.0


class EngineLink:
    """One EngineProcess and what the node does around it. Faults go to ctx.faults as "engine";
    `on_lost` runs when the worker is lost (the request in flight is gone with it), `on_restarted`
    once a replacement serves (nothing sent to the old worker is waited for)."""

    def __init__(self, ctx: NodeContext, on_lost: Callable[[], None], on_restarted: Callable[[], None]):
        s = ctx.settings
        self._ctx, self._telemetry, self._on_lost, self._on_restarted = ctx, ctx.telemetry, on_lost, on_restarted
        self.process = EngineProcess(s.engine, WorkerOptions(s.engine_mode, s.engine_threads, s.engine_nice),
                                     server=s.engine_server)
        self.info: Optional[EngineInfo] = None    # the last worker's; kept while it is lost
        self._restart_timer = None
        self._reconfiguring = 0                  # Reconfigure messages not answered yet
        self._refused = False                    # one of them was refused: restore the parameters

    def start(self, stage: Callable[[str], None], waiting: Callable[[], None]) -> EngineInfo:
        """Start the worker and wait until it is warm (configure), and check that its model fits
        the parameters; `stage` and `waiting` as EngineProcess.start's. Raises EngineError, or
        ValueError naming the parameter."""
        ctx, s = self._ctx, self._ctx.settings
        self.info = info = self.process.start(s.engine_start_timeout_s, ctx.logger.info, stage, waiting)
        if info.state_dim != len(s.joint_names) or info.action_dim != len(s.joint_names):
            raise ValueError(f"the model has state_dim {info.state_dim} and action_dim {info.action_dim}, "
                             f"joint_names has {len(s.joint_names)} joints")
        params.validate(params.current_values(ctx.ros), horizon=info.horizon)   # replan_threshold vs horizon
        return info

    @property
    def serving(self) -> bool:
        """A worker is there to answer (not lost, not being replaced)."""
        return self.process.lost is None

    def close(self) -> None:
        """End the worker (and a restart under way) and release the shared frames."""
        self._end_restart()
        self.process.close()

    # -- requests and answers -------------------------------------------------------------------
    def submit(self, request_id: int, window: Window, instruction: str,
               known_actions: Optional[np.ndarray]) -> bool:
        """Send one observation (with the actions its chunk must start with, if any); False if the
        worker could not be reached (it is lost then)."""
        try:
            self.process.submit(Predict(request_id, window.slots, window.frame_ids, window.state.astype(np.float32),
                                        instruction, window.stamp_ns / 1e9, known_actions, time.perf_counter()))
        except EngineError as e:
            self.lose(str(e))
            return False
        logger = self._ctx.logger
        if logger.is_enabled_for(LoggingSeverity.DEBUG):   # what the policy is shown, for replays
            logger.debug(f"observation {request_id}: frames {window.frame_ids} state {window.state.tolist()} "
                         f"stamped {window.state_stamps_ns.tolist()}")
        return True

    def poll(self, timeout_s: float = 0.0) -> Optional[Answer]:
        """The worker's answer to an observation (Chunk, Rejected or Failed), if one is waiting or
        comes within timeout_s (0: never blocks); an observation it rejected or failed on is
        reported here (fault "engine"), and answers to Reconfigure on the way are taken in; a dead
        worker is lost."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.serving:
                return None
            try:
                result = self.process.poll(max(0.0, deadline - time.monotonic()))
            except EngineError as e:
                self.lose(str(e))
                return None
            if not isinstance(result, Reconfigured):
                break
            self._reconfigured(result)
        if isinstance(result, Rejected):
            self._telemetry.counts[Key.REJECTED] += 1
            self._ctx.faults.set(FaultSource.ENGINE, f"observation rejected by the engine: {result.reason}")
        elif isinstance(result, Failed):
            self._ctx.logger.error(f"inference failed: {result.reason}\n{result.trace}", throttle_duration_sec=5.0)
            self._ctx.faults.set(FaultSource.ENGINE, f"inference failed: {result.reason}")
        return result

    def wait(self, request_id: int) -> Optional[Answer]:
        """poll() for the answer to `request_id`, which a fixed latency makes due at this tick,
        waiting up to FIXED_LATENCY_WAIT_S (the simulator waits for the tick meanwhile). Answers
        to older requests on the way are dropped: a restarted timeline forgot them, so they are
        stale. Fault "engine" if the answer does not come."""
        deadline = time.monotonic() + FIXED_LATENCY_WAIT_S
        while (result := self.poll(max(0.0, deadline - time.monotonic()))) is not None:
            if result.request_id == request_id:
                break
        if result is None and self.serving:
            self._ctx.faults.set(FaultSource.ENGINE, f"no answer from the engine {FIXED_LATENCY_WAIT_S:g} s after "
                                                     "the tick fixed_latency_s made it due")
        return result

    def latency_ticks(self, request) -> Optional[int]:
        """fixed_latency_s in ticks: the tick a request's answer is taken at; None: when it comes."""
        return self._ctx.settings.fixed_latency_ticks

    def reset_stream(self) -> None:
        """A new timeline: the engine's cached frames may carry stamps the new frames will reuse."""
        if self.serving:
            try:
                self.process.reset_stream()
            except EngineError as e:
                self.lose(str(e))

    def settings_changed(self, names: set[str], control) -> None:
        """Parameters `names` changed: the run-time engine options go to the engine, the
        post-processing (postprocess, max_joint_delta_scale) to `control` (control.ChunkScheduler)."""
        if names & {"postprocess", "max_joint_delta_scale"}:
            control.post = self.post_process()
        if names & set(RUNTIME_OPTIONS):
            self.reconfigure(self._ctx.settings.engine)

    def reconfigure(self, wanted: EngineConfig) -> None:
        """Send the run-time options (RUNTIME_OPTIONS) where `wanted` (the parameters) differs
        from the configuration the engine last answered with; its answer arrives in poll()."""
        changes = {name: getattr(wanted, name) for name in RUNTIME_OPTIONS
                   if getattr(wanted, name) != getattr(self.process.config, name)}
        if self.serving and changes:
            try:
                self.process.reconfigure(changes)
                self._reconfiguring += 1
            except EngineError as e:
                self.lose(str(e))

    def _reconfigured(self, answer: Reconfigured) -> None:
        """params.validate already refused malformed values; the engine checks again against the
        checkpoint (a schedule against its own flow steps), in its process (the control loop does
        not wait). Its answer is the configuration in effect: a value it refused is reported, and
        once no other change is on its way the parameters are set back to what it runs."""
        ctx = self._ctx
        self._reconfiguring = max(0, self._reconfiguring - 1)
        wanted = ctx.settings.engine
        if answer.error:
            self._refused = True
            ctx.logger.error(f"{answer.error}\n{answer.trace}")
        for name in RUNTIME_OPTIONS:
            value = getattr(answer.config, name)
            if not answer.error:
                ctx.logger.info(f"{name} {value!r} in effect")
            elif getattr(wanted, name) != value:
                ctx.logger.error(f"{name} {getattr(wanted, name)!r} refused by the engine: {answer.error}; "
                                 f"restored {value!r}")
        if self._refused and not self._reconfiguring:
            self._refused = False
            restore = [Parameter(name, value=getattr(answer.config, name)) for name in RUNTIME_OPTIONS
                       if getattr(wanted, name) != getattr(answer.config, name)]
            if restore:
                ctx.ros.set_parameters(restore)

    def post_process(self) -> PostProcess:
        """The checkpoint's action post-processing (its RobotConfig), as the parameters ask."""
        s = self._ctx.settings
        if s.postprocess == "none" or self.info is None:
            return PostProcess()
        return PostProcess.of(self.info.robot, s.max_joint_delta_scale)

    # -- a lost worker --------------------------------------------------------------------------
    def lose(self, reason: str) -> None:
        ctx = self._ctx
        ctx.faults.set(FaultSource.ENGINE, f"engine lost: {reason}")
        self._on_lost()
        self._reconfiguring, self._refused = 0, False
        restart_s = ctx.settings.engine_restart_s
        self.process.lose(reason, restart_s)
        if not restart_s:
            ctx.logger.error(f"engine lost: {reason}; cleanup and configure restart it (or set engine_restart_s)")
            return
        self._restart_timer = ctx.ros.create_timer(RESTART_POLL_S, self._step_restart,
                                                   clock=Clock(clock_type=ClockType.STEADY_TIME))
        ctx.logger.error(f"engine lost: {reason}; restarting it in {restart_s:g} s (engine_restart_s)")

    def _step_restart(self) -> None:
        """Resumes like a fresh activation once the new worker is warm: the next window goes out
        once the inputs are fresh."""
        ctx, s = self._ctx, self._ctx.settings
        retry_s = max(s.engine_restart_s, RESTART_POLL_S)   # also if it was set to 0 meanwhile
        try:
            info = self.process.step_restart(s.engine_start_timeout_s, retry_s, ctx.logger.info)
        except EngineError as e:
            ctx.faults.set(FaultSource.ENGINE, f"engine restart failed: {e}; retrying every {retry_s:g} s")
            return
        if info is None:
            return
        self.info = info
        self._end_restart()
        self._on_restarted()
        ctx.logger.info(f"engine restarted: {info.description}, engine process {info.pid}")
        ctx.faults.clear(FaultSource.ENGINE)
        self.reconfigure(s.engine)   # a new worker starts from the configure-time options

    def _end_restart(self) -> None:
        """Stop restarting: done, or cleanup (which then ends a worker still starting)."""
        if self._restart_timer is not None:
            self._ctx.ros.destroy_timer(self._restart_timer)
            self._restart_timer = None

    def pairs(self) -> list[tuple[str, object]]:
        """/diagnostics values: the engine, its process, a restart under way."""
        values = [(Key.ENGINE_SERVER, self.process.server)] if self.process.server else []
        if self.info is not None:
            values += [(Key.ENGINE, self.info.description),
                       (Key.ENGINE_PID, self.info.pid if self.serving else "none (lost)"),
                       (Key.HORIZON, self.info.horizon)]
        if self.process.restart_due is not None:
            values.append((Key.ENGINE_RESTART, f"attempt {self.process.restart_attempt}"))
        return values
