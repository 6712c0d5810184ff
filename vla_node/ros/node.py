"""The vla_node lifecycle node: cameras + joint states + instruction in, a fixed-rate joint
command and one joint trajectory per action chunk out.

    configure   load weights + tokenizer and warm up, in the engine process; subscribe to inputs
    activate    start the control loop; commands and trajectories flow
    deactivate  stop commanding (a forward command controller holds the last command)
    cleanup     end the engine process (its memory, device memory included, goes with it)

The control loop runs on the executor at control_rate_hz and never waits for the model: each
tick publishes one command, takes a finished chunk if the engine has one, and sends the newest
complete observation when the plan runs low. What to do at each tick is decided by
control.ChunkScheduler; this class connects it to ROS (inputs.Inputs, the engine process,
publishers, parameters, lifecycle). Everything unsafe makes it hold position and say why, once,
in the log and on /diagnostics.
"""
from __future__ import annotations

import gc
import signal
import sys
import time
from typing import Optional

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType, JumpThreshold
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.logging import LoggingSeverity
from rclpy.parameter import Parameter
from sensor_msgs.msg import JointState
from std_msgs.msg import Float64MultiArray
from trajectory_msgs.msg import JointTrajectory

from ..runtime.windows import Wait, WindowSpec, frames_to_keep
from . import messages, params
from .control import LATE, NON_FINITE, STALE, ChunkScheduler, PostProcess, SafetyFilter
from .diagnostics import Faults, Key, NodeTelemetry, summary
from .engine_process import EngineError, EngineInfo, EngineProcess, Result, WorkerOptions
from .frames import FrameRing
from .inputs import Inputs

# Faults the engine's next answer or the next observation sent clears: observations keep being
# sent while they are active.
RETRY_SOURCES = {"engine", "output", "sync", "clock", "timeline"}
DIAGNOSTICS_PERIOD_S = 1.0
RESTART_POLL_S = 0.1    # how often a restarting engine is checked (on the executor, never blocking)
NO_CHECKPOINT = ("no checkpoint: set checkpoint to a MolmoBot checkpoint folder (an official one with config.yaml "
                 "+ model.pt is converted on first use, or convert it with `vla-convert OFFICIAL_DIR OUT_DIR "
                 "[--tokenizer DIR]`), or random_weights: true for untrained weights (benchmarks and tests only: "
                 "the robot would move at random)")


class VLANode(LifecycleNode):
    def __init__(self, node_name: str = "vla_node", **kwargs):
        super().__init__(node_name, **kwargs)
        # Everything _release() touches exists before the parameters are read: a node whose
        # start-up parameters are refused is still destroyed cleanly (rclpy's shutdown does it).
        self._diagnostics_pub = self.create_publisher(DiagnosticArray, "/diagnostics", 10)
        # Fault changes publish diagnostics at once, from the executor (they may start on the
        # decoder thread).
        self._diagnostics_now = self.create_guard_condition(self._publish_diagnostics)
        self.faults = Faults(self.get_logger(), on_change=self._diagnostics_now.trigger)
        # Wall time: diagnostics keep coming while a simulation is paused.
        self.create_timer(DIAGNOSTICS_PERIOD_S, self._on_diagnostics_timer,
                          clock=Clock(clock_type=ClockType.STEADY_TIME))
        self._diagnostics_sent = 0.0    # time.monotonic() of the last /diagnostics message
        self._clock_jump = self.get_clock().create_jump_callback(
            JumpThreshold(min_forward=None, min_backward=Duration(nanoseconds=-1), on_clock_change=False),
            post_callback=self._on_clock_jump)
        self.telemetry = NodeTelemetry()
        self._state = "unconfigured"
        self._configure_error = ""
        self._engine: Optional[EngineProcess] = None    # configure .. cleanup, across losses of its worker
        self._info: Optional[EngineInfo] = None
        self._inputs: Optional[Inputs] = None
        self._command_pub = self._trajectory_pub = self._joint_command_pub = None
        self._control_timer = self._restart_timer = None
        self._control: Optional[ChunkScheduler] = None

        self.settings = params.declare(self)
        self.add_on_set_parameters_callback(self._validate_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        self._control = ChunkScheduler(self.settings, self._make_safety())
        self._offset_s = 0.0                       # history offset in effect (set by configure)

        # Startup (rclpy, the message types, numpy) can take seconds on a busy machine; this line
        # says the lifecycle services are up.
        self.get_logger().info(f"started: unconfigured{', autostart' if self.settings.autostart else ''}")
        if self.settings.autostart:
            if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                self.trigger_activate()

    # -- lifecycle ------------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        s, e = self.settings, self.settings.engine
        if not e.checkpoint and not s.random_weights:
            return self._fail_configure(NO_CHECKPOINT)
        self.get_logger().info(f"configuring: {e.checkpoint or e.preset} ({s.engine_mode}, {e.device}, {e.dtype})")
        try:
            self._engine = EngineProcess(e, WorkerOptions(s.engine_mode, s.engine_threads, s.engine_nice))
            self._info = self._engine.start(s.engine_start_timeout_s, self.get_logger().info)
            self._check_model(self._info)
            # The frame buffer holds the history span, whose length in time the checkpoint decides.
            self._offset_s = s.history_offset_s or self._info.history_offset_s
            slots = frames_to_keep(s.history_frames, self._offset_s, s.max_camera_rate_hz) + s.history_frames
            shape = FrameRing.shape_of(len(s.camera_names), s.camera_height, s.camera_width, slots)
            ring = FrameRing(list(s.camera_names), s.camera_height, s.camera_width, self._window_spec(), slots,
                             self._engine.share_frames(shape))
        except (EngineError, ValueError, OSError) as error:
            return self._fail_configure(str(error))
        self._command_pub = self.create_lifecycle_publisher(Float64MultiArray, "~/command", 10)
        self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 10)
        if s.publish_joint_command:
            self._joint_command_pub = self.create_lifecycle_publisher(JointState, "~/joint_command", 10)
        self._inputs = Inputs(self, ring, self.telemetry)
        self._configure_error = ""
        self._state = "inactive"
        self._control.post = self._make_post()
        source = "history_offset_s" if s.history_offset_s else "the checkpoint's"
        self.get_logger().info(f"configured: {self._info.description}, engine process {self._info.pid}; frames "
                               f"{self._offset_s:.3f} s apart ({source})")
        return super().on_configure(state)

    def _fail_configure(self, reason: str) -> TransitionCallbackReturn:
        self.get_logger().error(f"configure failed: {reason}")
        self._configure_error = reason
        self._release()
        self._diagnostics_now.trigger()
        return TransitionCallbackReturn.FAILURE

    def _check_model(self, info: EngineInfo) -> None:
        joints = len(self.settings.joint_names)
        if info.state_dim != joints or info.action_dim != joints:
            raise ValueError(f"the model has state_dim {info.state_dim} and action_dim {info.action_dim}, "
                             f"joint_names has {joints} joints")
        params.validate(params.current_values(self), horizon=info.horizon)   # replan_threshold vs horizon

    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._reset_control()
        if self._serving():
            self._engine.reset_stream()
        self.telemetry.loop.clear()
        self._control_timer = self._make_control_timer()
        self._control.state.hold = self._first_tick_wait()
        self._state = "active"
        # Everything allocated so far lives as long as the node: move it out of the collector's
        # reach, so a full collection never stalls a control tick for milliseconds.
        gc.collect()
        gc.freeze()
        self.get_logger().info(f"active: commanding at {self.settings.control_rate_hz:g} Hz")
        return super().on_activate(state)

    def _make_control_timer(self):
        # On the steady clock unless simulated: the loop must not follow steps or slewing of
        # the system clock (measured on the 2-core VM: p99 period jitter 0.9-2.4 ms on the
        # steady clock against 2.5-4.2 ms on the system clock, side by side).
        clock = self.get_clock() if self._sim_time() else Clock(clock_type=ClockType.STEADY_TIME)
        return self.create_timer(self.settings.control_period_s, self._on_tick, clock=clock)

    def _sim_time(self) -> bool:
        return self.get_parameter("use_sim_time").value

    def _first_tick_wait(self) -> str:
        """The hold until the first control tick: on simulated time, that tick needs /clock."""
        if self._sim_time() and self.get_clock().now().nanoseconds == 0:
            return "no /clock: use_sim_time is true and no simulated time has arrived yet"
        return "starting"

    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_control()
        self._state = "inactive"
        self.get_logger().info("inactive: commands stopped")
        return super().on_deactivate(state)

    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        self._state = "unconfigured"
        self.get_logger().info("cleaned up: engine process ended")
        return super().on_cleanup(state)

    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        had_engine = self._engine is not None
        self._release()
        self._state = "finalized"
        self.get_logger().info(f"shut down from {state.label}{': engine process ended' if had_engine else ''}")
        return super().on_shutdown(state)

    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error in state {state.label}: releasing the engine")
        self._release()
        self._state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self):
        self._release()
        super().destroy_node()

    def _stop_control(self) -> None:
        if self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = None
        self._reset_control()

    def _reset_control(self) -> None:
        if self._control is not None:     # None: parameters refused at start-up
            self._control.reset()
        if self._inputs is not None:
            self._inputs.reset()
            self._inputs.ring.unpin()

    def _release(self) -> None:
        """Undo configure, whatever part of it happened."""
        self._stop_control()
        for pub in (self._command_pub, self._trajectory_pub, self._joint_command_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._command_pub = self._trajectory_pub = self._joint_command_pub = None
        if self._inputs is not None:
            self._inputs.close()
            self._inputs = None
        self._end_restart()
        if self._engine is not None:    # after the inputs: nothing writes the frames any more
            self._engine.close()
        self._engine = self._info = None
        self.faults.reset()

    def _window_spec(self) -> WindowSpec:
        s = self.settings
        return WindowSpec.of(s.history_frames, self._offset_s, s.sync_slop_s, s.state_slop_s, s.wait_for_history)

    def now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def _serving(self) -> bool:
        """An engine worker is there to answer (not lost, not being replaced)."""
        return self._engine is not None and self._engine.lost is None

    # -- the control loop (its decisions: control.ChunkScheduler) ---------------------------------
    def _on_tick(self) -> None:
        started = time.perf_counter()
        now_ns = self.now_ns()
        if self._inputs.timeline_ended.is_set():
            self._inputs.timeline_ended.clear()
            self._drop_old_timeline()
        self._inputs.check(now_ns)
        target, ran_out = self._control.next_tick(self._blocking_cause())
        self._publish_command(target)
        self.telemetry.tick(started)
        if ran_out:
            self.telemetry.counts[Key.PLAN_UNDERRUNS] += 1
            self.get_logger().warning(f"plan ran out before the next chunk: {self._control.underrun_cause()}",
                                      throttle_duration_sec=5.0)
        self._collect()
        self._dispatch(now_ns)
        # Building /diagnostics takes a few milliseconds: while the loop runs it is done right
        # after a tick, where it cannot delay one.
        if time.monotonic() - self._diagnostics_sent >= DIAGNOSTICS_PERIOD_S:
            self._publish_diagnostics()

    def _blocking_cause(self) -> Optional[str]:
        """What stops the plan from running: the fault sources, or no instruction."""
        sources = self.faults.sources()
        if sources:
            return ", ".join(sorted(sources))
        if not self.settings.instruction.strip():
            return "no instruction"
        return None

    def _publish_command(self, target: Optional[np.ndarray]) -> None:
        command = self._control.command(target, self._inputs.joints.newest())
        if command is None:
            return     # not every joint known yet: publishing anything would be a guess
        self._command_pub.publish(messages.command_msg(command))
        if self._joint_command_pub is not None:
            self._joint_command_pub.publish(messages.joint_command_msg(self.settings.joint_names, command,
                                                                       self.get_clock().now().to_msg()))

    def _collect(self) -> None:
        """Take the engine's answer, if there is one."""
        if not self._serving():
            return
        arrived = time.perf_counter()
        try:
            result = self._engine.poll()
        except EngineError as e:
            self._lost_engine(str(e))
            return
        if result is None:
            return
        if result.kind == "schedule":
            self._schedule_answer(result)
            return
        request = self._control.answered(result.request_id)
        if request is not None:
            self._inputs.ring.unpin()
        if result.kind in ("rejected", "failed"):
            self.telemetry.counts[Key.REJECTED] += result.kind == "rejected"
            self.faults.set("engine", f"observation rejected by the engine: {result.reason}"
                            if result.kind == "rejected" else f"inference failed: {result.reason}")
            return
        outcome = self._control.take(request, result.actions)
        if outcome == STALE:
            self.telemetry.counts[Key.DISCARDED] += 1
            return
        if outcome == NON_FINITE:
            self.faults.set("output", "the chunk has non-finite actions; dropped")
            return
        self.faults.clear("engine")
        self.faults.clear("output")
        self.telemetry.chunk(request, result, arrived)   # the control loop has the chunk (or dropped it)
        if outcome == LATE:
            self.telemetry.counts[Key.LATE_CHUNKS] += 1
            self.get_logger().warning(f"chunk arrived {self._control.state.tick - request.tick} ticks after its "
                                      "request, after its last action: dropped (inference slower than the horizon)",
                                      throttle_duration_sec=5.0)
            return
        t0 = time.perf_counter()
        self._publish_trajectory()
        self.telemetry.trajectory_ms.add((time.perf_counter() - t0) * 1e3)
        self.telemetry.counts[Key.CHUNKS] += 1

    def _publish_trajectory(self) -> None:
        # The plan's relative moves, against the joints measured now.
        commands = self._control.upcoming_commands(self._inputs.joints.newest())
        period_ns = self._control_timer.timer_period_ns
        wait_ns = self._control_timer.time_until_next_call() or 0
        first = self.get_clock().now() + Duration(nanoseconds=wait_ns)
        self._trajectory_pub.publish(messages.trajectory_msg(self.settings.joint_names, commands, first.to_msg(),
                                                             period_ns))

    def _dispatch(self, now_ns: int) -> None:
        """Send the newest complete observation when the plan runs low and nothing is in flight."""
        s, control = self.settings, self._control
        if not self._serving() or not control.wants_observation():
            return
        if self.faults.sources() - RETRY_SOURCES or not s.instruction.strip():
            control.waiting(None)
            self._inputs.not_sending()
            return
        t0 = time.perf_counter()
        window = self._inputs.take_window(now_ns)
        if isinstance(window, Wait):
            control.waiting(window)
            return
        request = control.request(window)
        try:
            self._engine.submit(request.id, window.slots, window.frame_ids, window.state.astype(np.float32),
                                s.instruction.strip(), window.stamp_ns / 1e9)
        except OSError as e:
            self._inputs.ring.unpin()
            self._lost_engine(f"engine process unreachable: {e}")
            return
        request.sent_at = time.perf_counter()
        request.send_ms = (request.sent_at - t0) * 1e3
        control.sent(request)
        self.telemetry.counts[Key.REQUESTS] += 1
        if self.get_logger().is_enabled_for(LoggingSeverity.DEBUG):   # what the policy is shown, for replays
            self.get_logger().debug(f"observation {request.id}: frames {window.frame_ids} state "
                                    f"{window.state.tolist()} stamped {window.state_stamps_ns.tolist()}")

    def _drop_old_timeline(self) -> None:
        """An input's stamps stepped back or the clock jumped: forget the plan, drop the chunk in
        flight, and the engine's stream state (a frame of the new timeline may carry a stamp it
        has cached another picture under)."""
        if self._serving():
            self._engine.reset_stream()
        self._control.drop_plan()

    def _on_clock_jump(self, jump) -> None:
        """Time went backwards (a restarted simulation or bag): every stored stamp is from the
        future now. Forget the frames, the joints, the plan and the last command, and the
        engine's stream state too; the next complete window clears it."""
        if self._inputs is not None:
            self._inputs.forget()
        self._drop_old_timeline()
        # A restarted simulation has moved the robot: the hold restarts from its next measured
        # position, not from the last command of the old timeline. (Stamps stepping back without
        # a clock jump keep the last command: every command stays within max_step_per_tick.)
        self._control.state.last_command = None
        self.faults.set("clock", f"clock jumped back by {-jump.delta.nanoseconds / 1e9:.3f} s; "
                                 f"inputs and plan discarded")

    # -- a lost engine --------------------------------------------------------------------------
    def _lost_engine(self, reason: str) -> None:
        self.faults.set("engine", f"engine lost: {reason}")
        self._control.engine_lost()
        self._inputs.ring.unpin()
        restart_s = self.settings.engine_restart_s
        self._engine.lose(reason, restart_s)
        if not restart_s:
            self.get_logger().error(f"engine lost: {reason}; cleanup and configure restart it (or set "
                                    "engine_restart_s)")
            return
        self._restart_timer = self.create_timer(RESTART_POLL_S, self._step_restart,
                                                clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.get_logger().error(f"engine lost: {reason}; restarting it in {restart_s:g} s (engine_restart_s)")

    def _step_restart(self) -> None:
        """Resumes like a fresh activation once the new worker is warm: the next window goes out
        once the inputs are fresh."""
        s = self.settings
        retry_s = max(s.engine_restart_s, RESTART_POLL_S)   # also if it was set to 0 meanwhile
        try:
            info = self._engine.step_restart(s.engine_start_timeout_s, retry_s, self.get_logger().info)
        except EngineError as e:
            self.faults.set("engine", f"engine restart failed: {e}; retrying every {retry_s:g} s")
            return
        if info is None:
            return
        self._info = info
        self._end_restart()
        self.telemetry.counts[Key.ENGINE_RESTARTS] += 1
        self._control.drop_plan()     # nothing sent to the old worker is waited for
        self.get_logger().info(f"engine restarted: {info.description}, engine process {info.pid}")
        self.faults.clear("engine")
        if s.engine.action_cache != self._engine.config.action_cache:
            self._engine.set_action_cache(s.engine.action_cache)

    def _end_restart(self) -> None:
        """Stop restarting: done, or cleanup (which then ends a worker still starting)."""
        if self._restart_timer is not None:
            self.destroy_timer(self._restart_timer)
            self._restart_timer = None

    # -- parameters -----------------------------------------------------------------------------
    def _validate_parameters(self, changes: list[Parameter]) -> SetParametersResult:
        values = params.current_values(self)
        values.update({p.name: p.value for p in changes if p.name in params.SPECS})
        try:
            params.validate(values, horizon=self._info.horizon if self._info else None)
        except params.SettingsError as e:
            return SetParametersResult(successful=False, reason=str(e))
        return SetParametersResult(successful=True)

    def _apply_parameters(self, changes: list[Parameter]) -> None:
        old = self.settings
        self.settings = new = params.validate(params.current_values(self),
                                              horizon=self._info.horizon if self._info else None)
        self._control.params = new
        names = {p.name for p in changes}
        if "use_sim_time" in names and self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = self._make_control_timer()
            self.telemetry.loop.clear()
        elif new.control_rate_hz != old.control_rate_hz and self._control_timer is not None:
            self._control_timer.timer_period_ns = int(new.control_period_s * 1e9)
            self.telemetry.loop.clear()
        if names & {"joint_lower_limits", "joint_upper_limits", "max_step_per_tick"}:
            self._control.safety = self._make_safety()
        if names & {"postprocess", "max_joint_delta_scale"}:
            self._control.post = self._make_post()
        if "instruction" in names:
            self.faults.clear("instruction")
        if names & {"sync_slop_s", "state_slop_s", "wait_for_history"} and self._inputs is not None:
            self._inputs.ring.spec = self._window_spec()
        schedule = new.engine.action_cache
        if "action_cache" in names and self._serving() and schedule != self._engine.config.action_cache:
            self._engine.set_action_cache(schedule)

    def _schedule_answer(self, result: Result) -> None:
        """params.validate already refused malformed schedules; the engine checks again against
        the checkpoint's own flow steps, in its process (the control loop does not wait): a
        schedule it still refuses is reported and the parameter set back."""
        schedule, accepted = self.settings.engine.action_cache, self._engine.config.action_cache
        if not result.reason:
            self.get_logger().info(f"action_cache {accepted!r} in effect")
            return
        self.get_logger().error(f"action_cache {schedule!r} refused by the engine: {result.reason}; restored "
                                f"{accepted!r}")
        self.set_parameters([Parameter("action_cache", Parameter.Type.STRING, accepted)])

    def _make_post(self) -> PostProcess:
        s = self.settings
        if s.postprocess == "none" or self._info is None:
            return PostProcess()
        return PostProcess.of(self._info.robot, s.max_joint_delta_scale)

    def _make_safety(self) -> SafetyFilter:
        s = self.settings
        return SafetyFilter(s.joint_lower_limits, s.joint_upper_limits, s.max_step_per_tick)

    # -- diagnostics ----------------------------------------------------------------------------
    def _on_diagnostics_timer(self) -> None:
        """Diagnostics when no control tick sends them (inactive, or a paused simulation)."""
        self.faults.flush()
        newest = self.telemetry.loop.newest()
        if newest is None or time.perf_counter() - newest > 0.5:
            self._publish_diagnostics()

    def _publish_diagnostics(self) -> None:
        faults = self.faults.active()
        hold = self._control.state.hold if self._control is not None else "inactive"
        level, message = summary(self._state, self._configure_error, faults, hold)
        self._diagnostics_pub.publish(messages.diagnostics_msg(
            "vla_node: policy", self.get_fully_qualified_name(), level, message,
            self._diagnostic_values(faults, hold), self.get_clock().now().to_msg()))
        self._diagnostics_sent = time.monotonic()

    def _diagnostic_values(self, faults: dict, hold: Optional[str]) -> list:
        s = self.settings
        values = [(Key.STATE, self._state), (Key.HOLD, hold or "no"),
                  (Key.FAULTS, "; ".join(f"{k}: {v}" for k, v in sorted(faults.items())) or "none"),
                  (Key.HOLDS_BY_CAUSE, ", ".join(f"{k}={n}" for k, n in sorted(self.faults.events.items())) or "none")]
        if self._configure_error:
            values.append((Key.CONFIGURE_ERROR, self._configure_error))
        if self._info is not None:
            values += [(Key.ENGINE, self._info.description),
                       (Key.ENGINE_PID, self._info.pid if self._serving() else "none (lost)"),
                       (Key.HORIZON, self._info.horizon)]
        if self._engine is not None and self._engine.restart_due is not None:
            values.append((Key.ENGINE_RESTART, f"attempt {self._engine.restart_attempt}"))
        control = self._control.state if self._control is not None else None
        values += [(Key.CONTROL_RATE_HZ, s.control_rate_hz),
                   (Key.TICKS, control.tick if control else 0)]
        if control and control.latency_ticks:
            values.append((Key.LATENCY_TICKS_MAX, max(control.latency_ticks)))
        values += self.telemetry.pairs(s.control_period_s, self._sim_time(), s.engine.device)
        if self._inputs is not None:
            values.append((Key.FRAMES_DROPPED_UNCONVERTED, self._inputs.decoder.dropped))
            values += self._inputs.age_pairs(self.now_ns())
        return values


def main(args=None) -> int:
    rclpy.init(args=args)
    node = executor = None
    try:
        node = VLANode()
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        executor.spin()
    except (KeyboardInterrupt, ExternalShutdownException):
        pass
    except params.SettingsError as e:
        print(f"vla_node: invalid parameters: {e}", file=sys.stderr)
        return 1
    except Exception:
        # Ctrl-C shuts the context down from rclpy's signal handler, also in the middle of a
        # callback, whose next publish then fails: that is the end that was asked for.
        if rclpy.ok():
            raise
    finally:
        # Ctrl-C also raises KeyboardInterrupt here, and it can come after spin has ended on the
        # shutdown: it must not cut the release of the engine short (bounded: the engine process
        # is killed after a timeout).
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
        # Activation froze every object alive then (gc.freeze): unless they are collected now,
        # the ROS context among them is never destroyed, and neither is its DDS participant,
        # which then leaves its shared memory behind in /dev/shm.
        node = executor = None
        gc.unfreeze()
        gc.collect()
    return 0


if __name__ == "__main__":
    sys.exit(main())
