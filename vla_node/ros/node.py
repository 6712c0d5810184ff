"""The vla_node lifecycle node: cameras + joint states + instruction in, a fixed-rate joint
command and one joint trajectory per action chunk out.

    configure   load weights + tokenizer and warm up, in the engine process; subscribe to inputs
    activate    start the control loop; commands and trajectories flow
    deactivate  stop commanding (a forward command controller holds the last command)
    cleanup     end the engine process (its memory, device memory included, goes with it)

Threads: everything that changes the node runs in its default callback group, one callback at a time, on
the spinning thread, except the transitions (executor.TransitionsApartExecutor: configure waits there for
the engine to load and warm up, 20-45 s on a GPU, while the services that only read answer, so `ros2
lifecycle get` says `configuring` and /diagnostics which stage; destroy_node waits for a transition under
way). With autostart, configure starts once the executor spins, not in the constructor.

The control loop runs on the executor at control_rate_hz and never waits for the model: each tick
(loop.ControlLoop, which the simulator runs too) publishes one command, takes a finished chunk if the engine
has one, and sends the newest complete observation when the plan runs low, as control.ChunkScheduler
decides; this class connects them to ROS (inputs.Inputs, engine_link.EngineLink, outputs.Outputs,
parameters, lifecycle). Everything unsafe makes it hold and say why, once, in the log and on /diagnostics.
"""
from __future__ import annotations

import gc
import threading
from typing import Optional

from rclpy.clock import Clock, ClockType, JumpThreshold
from rclpy.duration import Duration
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.parameter import Parameter

from ..runtime.types import history_offset
from . import params
from .context import NodeContext
from .control import ChunkScheduler, SafetyFilter
from .diagnostics import Faults, FaultSource, NodeTelemetry
from .engine_link import EngineLink
from .engine_process import EngineError
from .executor import ANSWERED_APART, answer_apart, transition
from .inputs import Inputs
from .loop import ControlLoop, clock_jumped_back
from .outputs import DiagnosticsPublisher, Outputs, node_status

# configure's last stage, after the engine's (engine_protocol.STARTING, ...)
SUBSCRIBING = "subscribing to the inputs"

SHUTTING_DOWN = "the node is shutting down"
NO_CHECKPOINT = ("no checkpoint: set checkpoint to a MolmoBot checkpoint folder (an official one with config.yaml "
                 "+ model.pt is converted on first use, or convert it with `vla-convert OFFICIAL_DIR OUT_DIR "
                 "[--tokenizer DIR]`), or random_weights: true for untrained weights (benchmarks and tests only: "
                 "the robot would move at random)")


class VLANode(LifecycleNode):
    def __init__(self, node_name: str = "vla_node", **kwargs):
        super().__init__(node_name, **kwargs)
        answer_apart(self, ANSWERED_APART)
        # Everything _release() touches exists before the parameters are read: a node whose
        # start-up parameters are refused is still destroyed cleanly (rclpy's shutdown does it).
        self._diagnostics = DiagnosticsPublisher(self, self._status,   # the timer: when no tick publishes
                                                 lambda: self._diagnostics.when_idle(self.faults, self.telemetry))
        self.faults = Faults(self.get_logger(), on_change=self._diagnostics.now)
        self._clock_jump = self.get_clock().create_jump_callback(
            JumpThreshold(min_forward=None, min_backward=Duration(nanoseconds=-1), on_clock_change=False),
            post_callback=self._on_clock_jump)
        self.telemetry = NodeTelemetry()
        self._ctx = NodeContext(self, self.faults, self.telemetry, lambda: self.settings)
        self._state = "unconfigured"
        self._configure_stage = ""
        self._configure_error = ""
        self._autostart_timer = None
        self._exit_timer = None
        self.teardown = threading.RLock()   # a transition against destroy_node (executor.transition)
        self._steady_clock = Clock(clock_type=ClockType.STEADY_TIME)   # timers that never follow the system clock
        self._engine: Optional[EngineLink] = None    # configure .. cleanup, across losses of its worker
        self._inputs: Optional[Inputs] = None
        self._outputs: Optional[Outputs] = None
        self._control_timer = None
        self._control: Optional[ChunkScheduler] = None
        self._loop: Optional[ControlLoop] = None

        self.settings = params.declare(self)
        self.add_pre_set_parameters_callback(lambda changes: params.check_types(self, changes))
        self.add_on_set_parameters_callback(lambda changes: params.check_changes(self, changes, self._horizon()))
        self.add_post_set_parameters_callback(self._apply_parameters)
        self._control = ChunkScheduler(self.settings, SafetyFilter.of(self.settings))

        # Startup (rclpy, the message types, numpy) can take seconds on a busy machine; this line
        # says the lifecycle services are up.
        self.get_logger().info(f"started: unconfigured{', autostart' if self.settings.autostart else ''}")
        if self.settings.autostart:   # once the executor spins, so that the services answer meanwhile
            self._autostart_timer = self.create_timer(0.0, self._autostart, clock=self._steady_clock)

    def transition_entities(self) -> list:
        """The change_state service and the autostart timer: TransitionsApartExecutor's `apart`."""
        services = [s for s in self.services if s.srv_name.rsplit("/", 1)[-1] == "change_state"]
        return services + ([self._autostart_timer] if self._autostart_timer is not None else [])

    def _autostart(self) -> None:
        if self._autostart_timer is None:
            return
        self.destroy_timer(self._autostart_timer)
        self._autostart_timer = None
        if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
            self.trigger_activate()

    # -- lifecycle ------------------------------------------------------------------------------
    @transition
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        s, e = self.settings, self.settings.engine
        if not e.checkpoint and not s.random_weights:
            return self._fail_configure(NO_CHECKPOINT)
        self.get_logger().info(f"configuring: {e.checkpoint or e.preset} ({s.engine_mode}, {e.device}, {e.dtype})")
        self._state = "configuring"
        try:
            # A worker is lost (EngineLink restarts it) only once the control loop runs.
            self._engine = EngineLink(self._ctx, lambda: self._loop.engine_lost(),
                                      lambda: self._loop.engine_restarted())
            info = self._engine.start(self._configuring, self._while_configuring)
            self._configuring(SUBSCRIBING)
            offset_s = history_offset(s.history_offset_s, info.history_offset_s)
            self._inputs = Inputs(self._ctx, self._engine.process, offset_s)
        except Exception as error:   # once Ctrl-C or SIGTERM shut the context down, a publish fails too
            if self.context.ok() and not isinstance(error, (EngineError, ValueError, OSError)):
                raise
            return self._fail_configure(str(error) if self.context.ok() else SHUTTING_DOWN, getattr(error, "trace", ""))
        self._outputs = Outputs(self._ctx)
        self._loop = ControlLoop(self._control, self._engine, self._inputs, self._outputs, self.faults, self.telemetry,
                                 lambda: self.settings, self.get_logger())
        self._configure_error = ""
        self._state = "inactive"
        self._control.post = self._engine.post_process()
        source = "history_offset_s" if s.history_offset_s else "the checkpoint's"
        self.get_logger().info(f"configured: {info.description}, engine process {info.pid}; frames "
                               f"{offset_s:.3f} s apart ({source})")
        return super().on_configure(state)

    def _configuring(self, stage: str) -> None:
        """Configure entered `stage`: on /diagnostics at once."""
        self._configure_stage = stage
        self.get_logger().debug(f"configuring: {stage}")
        self._diagnostics.publish()

    def _while_configuring(self) -> None:
        """Between looks at the engine's start: /diagnostics once a second (configure holds the
        default callback group, where the diagnostics timer runs), and an end to the wait when the
        node shuts down (ending the node waits for this callback)."""
        if not self.context.ok():
            raise EngineError(SHUTTING_DOWN)
        self._diagnostics.after_tick()

    def _fail_configure(self, reason: str, trace: str = "") -> TransitionCallbackReturn:
        self.get_logger().error(f"configure failed: {reason}" + (f"\n{trace}" if trace else ""))
        self._configure_error = reason
        self._state = "unconfigured"
        self._release()
        self._diagnostics.now()
        return TransitionCallbackReturn.FAILURE

    @transition
    def on_activate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._reset_control()
        self._engine.reset_stream()
        self.telemetry.loop.clear()
        self._control_timer = self._outputs.timer = self._make_control_timer()
        self._control.hold(self._first_tick_wait())
        self._state = "active"
        # Everything allocated so far lives as long as the node: move it out of the collector's
        # reach, so a full collection never stalls a control tick for milliseconds.
        gc.collect()
        gc.freeze()
        self.get_logger().info(f"active: commanding at {self.settings.control_rate_hz:g} Hz")
        return super().on_activate(state)

    def _make_control_timer(self):
        # On the steady clock unless simulated: the loop must not follow steps or slewing of the system clock
        # (measured on the 2-core VM: p99 period jitter 0.9-2.4 ms on it against 2.5-4.2 ms on the system clock).
        clock = self.get_clock() if self._sim_time() else self._steady_clock
        return self.create_timer(self.settings.control_period_s, self._on_tick, clock=clock)

    def _sim_time(self) -> bool:
        return self.get_parameter("use_sim_time").value

    def _first_tick_wait(self) -> str:
        """The hold until the first control tick: on simulated time, that tick needs /clock."""
        if self._sim_time() and self.get_clock().now().nanoseconds == 0:
            return "no /clock: use_sim_time is true and no simulated time has arrived yet"
        return "starting"

    @transition
    def on_deactivate(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._stop_control()
        self._state = "inactive"
        self.get_logger().info("inactive: commands stopped")
        return super().on_deactivate(state)

    @transition
    def on_cleanup(self, state: LifecycleState) -> TransitionCallbackReturn:
        self._release()
        self._state = "unconfigured"
        self.get_logger().info("cleaned up: engine process ended")
        return super().on_cleanup(state)

    @transition
    def on_shutdown(self, state: LifecycleState) -> TransitionCallbackReturn:
        had_engine = self._engine is not None
        self._release()
        self._state = "finalized"
        self.get_logger().info(f"shut down from {state.label}{': engine process ended' if had_engine else ''}")
        if self.settings.exit_on_finalize:   # by a timer: the process ends once this transition has answered
            self._exit_timer = self.create_timer(0.0, self._exit_finalized, clock=self._steady_clock)
        return super().on_shutdown(state)

    def _exit_finalized(self) -> None:
        self.destroy_timer(self._exit_timer)
        self.get_logger().info("finalized: exiting (exit_on_finalize)")
        self.context.try_shutdown()     # spin ends; main releases everything and returns 0

    @transition
    def on_error(self, state: LifecycleState) -> TransitionCallbackReturn:
        self.get_logger().error(f"error in state {state.label}: releasing the engine")
        self._release()
        self._state = "unconfigured"
        return TransitionCallbackReturn.SUCCESS

    def destroy_node(self):
        with self.teardown:
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

    def _release(self) -> None:
        """Undo configure, whatever part of it happened."""
        self._stop_control()
        if self._outputs is not None:
            self._outputs.close()
            self._outputs = None
        if self._inputs is not None:
            self._inputs.close()
            self._inputs = None
        self._loop = None
        if self._engine is not None:    # after the inputs: nothing writes the frames any more
            self._engine.close()
            self._engine = None
        self.faults.reset()

    def now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def _horizon(self) -> Optional[int]:
        return self._engine.info.horizon if self._engine is not None and self._engine.info else None

    # -- the control loop (its order: loop.ControlLoop; its decisions: control.ChunkScheduler) ----
    def _on_tick(self) -> None:
        self._loop.tick(self.now_ns())
        self._diagnostics.after_tick(commanding=self._control.state.hold is None)

    def _on_clock_jump(self, jump) -> None:
        """Time went backwards (a restarted simulation or bag): loop.clock_jumped_back."""
        clock_jumped_back(-jump.delta.nanoseconds / 1e9, self._control, self.faults, self._inputs, self._engine)

    # -- parameters -----------------------------------------------------------------------------
    def _apply_parameters(self, changes: list[Parameter]) -> None:
        old = self.settings
        self.settings = new = params.validate(params.current_values(self), horizon=self._horizon())
        self._control.params = new
        names = {p.name for p in changes}
        if "use_sim_time" in names and self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = self._outputs.timer = self._make_control_timer()
            self.telemetry.loop.clear()
        elif new.control_rate_hz != old.control_rate_hz and self._control_timer is not None:
            self._control_timer.timer_period_ns = int(new.control_period_s * 1e9)
            self.telemetry.loop.clear()
        if names & {"joint_lower_limits", "joint_upper_limits", "max_step_per_tick"}:
            self._control.safety = SafetyFilter.of(new)
        if "instruction" in names:
            self.faults.clear(FaultSource.INSTRUCTION)
        if self._inputs is not None and names & {"sync_slop_s", "state_slop_s", "wait_for_history", "state_sync"}:
            self._inputs.configure()
        if self._engine is not None:
            self._engine.settings_changed(names, self._control)

    # -- diagnostics ----------------------------------------------------------------------------
    def _status(self) -> tuple[int, str, list]:
        """/diagnostics: level, message and values."""
        return node_status(self._state, self._configure_stage, self._configure_error, self.faults, self._control,
                           (self._engine, self._inputs), self.telemetry, self.settings, self._sim_time(), self.now_ns())
