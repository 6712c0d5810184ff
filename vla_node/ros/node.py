"""The vla_node lifecycle node: cameras + joint states + instruction in, a fixed-rate joint
command and one joint trajectory per action chunk out.

    configure   load weights + tokenizer and warm up, in the engine process; subscribe to inputs
    activate    start the control loop; commands and trajectories flow
    deactivate  stop commanding (a forward command controller holds the last command)
    cleanup     end the engine process (its memory, device memory included, goes with it)

The control loop runs on the executor at control_rate_hz and never waits for the model: each
tick publishes one command, takes a finished chunk if the engine has one, and sends the newest
complete observation when the plan runs low. Everything unsafe makes it hold position and say
why, once, in the log and on /diagnostics.
"""
from __future__ import annotations

import gc
import signal
import sys
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus
from rcl_interfaces.msg import SetParametersResult
from rclpy.clock import Clock, ClockType, JumpThreshold
from rclpy.duration import Duration
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.lifecycle import LifecycleNode, LifecycleState, TransitionCallbackReturn
from rclpy.logging import LoggingSeverity
from rclpy.parameter import Parameter
from rclpy.qos import qos_profile_sensor_data
from rclpy.subscription import Subscription
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Bool, Float64MultiArray, String
from trajectory_msgs.msg import JointTrajectory

from ..runtime import images
from ..runtime.windows import InputError, JointStates, StampStep, Wait, WindowSpec, frames_to_keep
from . import FRAME_TRANSPORT_PROFILE, messages, params
from .control import LATENCY_WINDOW, Plan, PostProcess, SafetyFilter
from .diagnostics import Faults, Rolling, key_values, percentile_pairs
from .engine_process import EngineError, EngineInfo, EngineProcess, Result
from .frames import FrameRing, Window

STAGES = ("preprocess", "vision", "llm", "action", "total")
# Faults the engine's next answer or the next observation sent clears: observations keep being
# sent while they are active.
RETRY_SOURCES = {"engine", "output", "sync", "clock", "timeline"}
STATS_WINDOW = 1000     # samples in each rolling statistic (20 s of ticks at 50 Hz)
DIAGNOSTICS_PERIOD_S = 1.0
RESTART_POLL_S = 0.1    # how often a restarting engine is checked (on the executor, never blocking)
NO_CHECKPOINT = ("no checkpoint: set checkpoint to a MolmoBot checkpoint folder (an official one with config.yaml "
                 "+ model.pt is converted on first use, or convert it with `vla-convert OFFICIAL_DIR OUT_DIR "
                 "[--tokenizer DIR]`), or random_weights: true for untrained weights (benchmarks and tests only: "
                 "the robot would move at random)")


@dataclass
class Request:
    id: int
    tick: int           # the tick after which it was sent: its chunk starts at tick + 1
    epoch: int
    window: Window
    sent_at: float      # time.perf_counter()
    send_ms: float      # node time spent choosing the window and sending it
    late_ticks: int = 0         # ticks it was sent after the plan ran low ...
    late_because: str = ""      # ... and why (the inputs it waited for)


@dataclass
class EngineRestart:
    """A lost engine being replaced: its worker is respawned at `due` (time.monotonic()), then
    polled until warm; a failed start is retried engine_restart_s later."""
    due: float
    attempt: int = 1
    spawned: bool = False


class Decoder:
    """Converts camera frames off the executor thread, which runs the control loop: a 640x480
    JPEG takes ~2 ms to decode and even a raw frame's copy ~0.2 ms (more under load), and both
    OpenCV and numpy's large copies release the GIL. Only the newest unconverted frame of a
    camera is kept (stale frames are dropped, never queued), with the time it arrived: a frame
    converted late must not look fresh. Cameras are served oldest-waiting first, so a busy
    camera cannot starve another."""

    def __init__(self, ingest):
        self._ingest = ingest
        self._pending: dict[int, tuple[Image | CompressedImage, int]] = {}   # camera -> (msg, arrival ns)
        self._wake = threading.Condition()
        self._stop = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="vla_node_decoder", daemon=True)
        self._thread.start()

    def push(self, camera: int, msg: Image | CompressedImage, arrived_ns: int) -> None:
        with self._wake:
            self.dropped += camera in self._pending
            self._pending[camera] = (msg, arrived_ns)   # a replaced entry keeps its place in the queue
            self._wake.notify()

    def _run(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending or self._stop)
                if self._stop:
                    return
                camera = next(iter(self._pending))
                msg, arrived_ns = self._pending.pop(camera)
            fill = images.compressed_into if isinstance(msg, CompressedImage) else images.image_into
            self._ingest(camera, msg, arrived_ns, fill)

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()


class VLANode(LifecycleNode):
    def __init__(self, **kwargs):
        super().__init__("vla_node", **kwargs)
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

        self._state = "unconfigured"
        self._configure_error = ""
        self._engine: Optional[EngineProcess] = None
        self._info: Optional[EngineInfo] = None
        self._ring: Optional[FrameRing] = None
        self._decoder: Optional[Decoder] = None
        self._inputs: dict[str, Subscription] = {}   # by fault source: "camera 'exo'", "joint_states", ...
        self._command_pub = self._trajectory_pub = self._joint_command_pub = None
        self._control_timer = None
        # A lost engine: its worker has ended, but the frame ring still writes into its shared
        # frames, so they stay mapped until cleanup (or until a restarted worker uses them again).
        self._lost: Optional[EngineProcess] = None
        self._restart: Optional[EngineRestart] = None   # while the lost engine is being restarted
        self._restart_timer = None
        self._engine_restarts = 0
        self._epoch = 0
        self._reset_control()

        self.settings = params.declare(self)
        self.add_on_set_parameters_callback(self._validate_parameters)
        self.add_post_set_parameters_callback(self._apply_parameters)
        self._safety = self._make_safety()
        self._post = PostProcess()      # the checkpoint's deployment post-processing, set on configure
        self._joints = JointStates(self.settings.joint_names)   # recent samples per joint, by header stamp
        self._timeline_ended = threading.Event()   # an input's stamps stepped back: the control loop resets
        self._offset_s = 0.0                       # history offset in effect (set by configure)
        self._next_request_id = 0
        self._schedule_accepted = self.settings.action_cache

        self._loop_period = Rolling(STATS_WINDOW)     # control tick start times (steady clock, s)
        self._stage_ms = {s: Rolling(200) for s in STAGES}
        self._predict_ms = Rolling(200)
        self._overhead_ms = Rolling(200)
        # Its parts: choosing + sending the window, the hop to the worker, the worker's wrapping
        # around predict(), taking the answer in.
        self._overhead_parts_ms = {part: Rolling(200) for part in ("send", "to_worker", "worker", "take")}
        self._round_trip_ms = Rolling(200)
        self._trajectory_ms = Rolling(200)      # building + publishing ~/joint_trajectory, after the plan
        self._ingest_ms = Rolling(STATS_WINDOW)
        # chunks: taken into the plan (each publishes a trajectory); late_chunks: arrived after
        # their last action's tick, so nothing of them could execute.
        self._counts = dict(chunks=0, late_chunks=0, requests=0, rejected=0, discarded=0, observations_dropped=0,
                            plan_underruns=0)
        self._memory = None

        # Startup (rclpy, the message types, numpy) can take seconds on a busy machine; this line
        # says the lifecycle services are up.
        self.get_logger().info(f"started: unconfigured{', autostart' if self.settings.autostart else ''}")
        if self.settings.autostart:
            if self.trigger_configure() == TransitionCallbackReturn.SUCCESS:
                self.trigger_activate()

    # -- lifecycle ------------------------------------------------------------------------------
    def on_configure(self, state: LifecycleState) -> TransitionCallbackReturn:
        s = self.settings
        if not s.checkpoint and not s.random_weights:
            return self._fail_configure(NO_CHECKPOINT)
        self._joints = JointStates(s.joint_names)   # nothing heard yet
        self.get_logger().info(f"configuring: {s.model_preset if not s.checkpoint else s.checkpoint} "
                               f"({s.engine_mode}, {s.device}, {s.dtype})")
        try:
            self._engine = EngineProcess(self._engine_options())
            self._info = self._engine.start(s.engine_start_timeout_s, self.get_logger().info)
            self._check_model(self._info)
            # The frame buffer holds the history span, whose length in time the checkpoint decides.
            self._offset_s = s.history_offset_s or self._info.history_offset_s
            slots = frames_to_keep(s.history_frames, self._offset_s, s.max_camera_rate_hz) + s.history_frames
            shape = FrameRing.shape_of(len(s.camera_names), s.camera_height, s.camera_width, slots)
            self._ring = FrameRing(list(s.camera_names), s.camera_height, s.camera_width, self._window_spec(), slots,
                                   self._engine.share_frames(shape))
        except (EngineError, ValueError, OSError) as e:
            return self._fail_configure(str(e))
        self._command_pub = self.create_lifecycle_publisher(Float64MultiArray, "~/command", 10)
        self._trajectory_pub = self.create_lifecycle_publisher(JointTrajectory, "~/joint_trajectory", 10)
        if s.publish_joint_command:
            self._joint_command_pub = self.create_lifecycle_publisher(JointState, "~/joint_command", 10)
        self._subscribe()
        self._configure_error = ""
        self._state = "inactive"
        self._post = self._make_post()
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
        if self._engine is not None:    # None: lost, and being restarted or waiting for cleanup
            self._engine.reset_stream()
        self._loop_period.clear()
        self._control_timer = self._make_control_timer()
        self._hold = self._first_tick_wait()
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
        had_engine = self._engine is not None or self._lost is not None
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

    def _release(self) -> None:
        """Undo configure, whatever part of it happened."""
        self._stop_control()
        for sub in self._inputs.values():
            self.destroy_subscription(sub)
        self._inputs = {}
        for pub in (self._command_pub, self._trajectory_pub, self._joint_command_pub):
            if pub is not None:
                self.destroy_lifecycle_publisher(pub)
        self._command_pub = self._trajectory_pub = self._joint_command_pub = None
        if self._decoder is not None:
            self._decoder.close()
            self._decoder = None
        self._ring = None
        self._end_restart()
        for engine in (self._engine, self._lost):   # after the ring: nothing writes the frames any more
            if engine is not None:
                engine.close()
        self._engine = self._lost = None
        self._info = None
        self.faults.reset()

    def _reset_control(self) -> None:
        self._tick = 0
        self._plan = Plan()
        self._last_command: Optional[np.ndarray] = None
        self._in_flight: Optional[Request] = None
        self._epoch += 1            # results of earlier requests are dropped
        self._blocked: Optional[str] = None
        self._hold: Optional[str] = "inactive"
        self._activated_ns: Optional[int] = None
        self._latency_ticks = Rolling(LATENCY_WINDOW)
        self._wait: Optional[Wait] = None
        self._sync_wait_since: Optional[int] = None
        self._late_since: Optional[int] = None     # tick since which an observation is due but waits
        self._last_window_seq: Optional[int] = None
        if self._ring is not None:
            self._ring.unpin()

    def _engine_options(self) -> dict:
        s = self.settings
        return dict(mode=s.engine_mode, preset=s.model_preset, checkpoint=s.checkpoint, device=s.device,
                    dtype=s.dtype, seed=s.seed, flow_steps=s.flow_steps,
                    max_instruction_tokens=s.max_instruction_tokens, camera_height=s.camera_height,
                    camera_width=s.camera_width, cameras=list(s.camera_names), frames=s.history_frames,
                    action_cache=s.action_cache, streaming_kv=s.streaming_kv, fp8=s.fp8,
                    threads=s.engine_threads, nice=s.engine_nice)

    def _window_spec(self) -> WindowSpec:
        s = self.settings
        return WindowSpec.of(s.history_frames, self._offset_s, s.sync_slop_s, s.state_slop_s, s.wait_for_history)

    # -- inputs ---------------------------------------------------------------------------------
    def _subscribe(self) -> None:
        s = self.settings
        self._decoder = Decoder(self._ingest)
        for i, topic in enumerate(s.camera_topics):
            kind = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            self._inputs[self._camera_source(i)] = self.create_subscription(
                kind, topic, lambda m, i=i: self._decoder.push(i, m, self._now_ns()), qos_profile_sensor_data)
        self._inputs["joint_states"] = self.create_subscription(JointState, s.joint_states_topic,
                                                                self._on_joint_state, qos_profile_sensor_data)
        self._inputs["instruction"] = self.create_subscription(String, s.instruction_topic, self._on_instruction, 10)
        self._inputs["estop"] = self.create_subscription(Bool, s.estop_topic, self._on_estop, 10)

    def _camera_source(self, camera: int) -> str:
        return f"camera {self.settings.camera_names[camera]!r}"

    def _ingest(self, camera: int, msg, arrived_ns: int, fill) -> None:
        """Store one camera frame (on the decoder thread)."""
        t0 = time.perf_counter()
        ring = self._ring
        if ring is None:
            return
        stamp = messages.stamp_ns(msg.header.stamp)
        try:
            try:
                ring.write(camera, stamp, arrived_ns, lambda out: fill(msg, out))
            except StampStep as step:   # the first frame of a new timeline: forget the old one, keep this
                self._end_timeline(step)
                ring.write(camera, stamp, arrived_ns, lambda out: fill(msg, out))
        except InputError as e:
            self.faults.set(self._camera_source(camera), str(e))
            return
        self._ingest_ms.add((time.perf_counter() - t0) * 1e3)
        self.faults.clear(self._camera_source(camera))

    def _on_joint_state(self, msg: JointState) -> None:
        """Samples of the configured joints, however the drivers split them into messages; a
        message naming none of them (another robot part's driver) is not an error."""
        stamp, now = messages.stamp_ns(msg.header.stamp), self._now_ns()
        try:
            try:
                named = self._joints.add(stamp, msg.name, msg.position, now)
            except StampStep as step:   # the first message of a new timeline: forget the old one, keep this
                self._end_timeline(step)
                named = self._joints.add(stamp, msg.name, msg.position, now)
        except InputError as e:
            self.faults.set("joint_states", str(e))
            return
        if named:
            self.faults.clear("joint_states")

    def _end_timeline(self, step: StampStep) -> None:
        """An input's stamps stepped back (any thread): a recorded simulation reset, an NTP
        step, a restarted driver. Every stored frame and joint state belongs to the old timeline
        and is forgotten at once; the control loop drops the plan and the chunk in flight on its
        next tick. Observations resume with inputs that all arrived after the step."""
        if self._ring is not None:
            self._ring.clear()
        self._joints.clear()
        self._timeline_ended.set()
        self.faults.set("timeline", f"{step}: inputs and plan discarded, resuming with inputs stamped after it")

    def _drop_old_timeline(self) -> None:
        """The control loop's part of _end_timeline and of a clock jump: forget the plan, drop the
        chunk in flight, and the engine's stream state (a frame of the new timeline may carry a
        stamp it has cached another picture under)."""
        if self._engine is not None:
            self._engine.reset_stream()
        self._plan.clear()
        self._epoch += 1

    def _on_instruction(self, msg: String) -> None:
        text = msg.data.strip()
        if not text:
            self.faults.set("instruction", f"empty instruction on {self._inputs['instruction'].topic_name}; "
                                           f"holding until a non-empty one arrives")
            return
        result = self.set_parameters([Parameter("instruction", Parameter.Type.STRING, text)])[0]
        if not result.successful:
            self.faults.set("instruction", f"instruction refused: {result.reason}")

    def _on_estop(self, msg: Bool) -> None:
        if msg.data:
            self.faults.set("estop", f"e-stop engaged on {self._inputs['estop'].topic_name}")
        else:
            self.faults.clear("estop")

    def _on_clock_jump(self, jump) -> None:
        """Time went backwards (a restarted simulation or bag): every stored stamp is from the
        future now. Forget the frames, the joints, the plan and the last command, and the
        engine's stream state too (a replayed frame may carry a stamp it has cached another
        picture under); the next complete window clears it."""
        if self._ring is not None:
            self._ring.clear()
        self._joints.clear()
        self._drop_old_timeline()
        # A restarted simulation has moved the robot: the hold restarts from its next measured
        # position, not from the last command of the old timeline. (Stamps stepping back without
        # a clock jump keep the last command: every command stays within max_step_per_tick.)
        self._last_command = None
        self.faults.set("clock", f"clock jumped back by {-jump.delta.nanoseconds / 1e9:.3f} s; "
                                 f"inputs and plan discarded")

    def _check_input_ages(self, now_ns: int) -> None:
        timeout_ns = int(self.settings.input_timeout_s * 1e9)
        active = self.faults.sources()
        ages = list(zip(range(len(self.settings.camera_names)), self._ring.newest_received_ns()))
        for camera, received in ages:
            source = self._camera_source(camera)
            self._check_age(f"{source} stale", source, received, now_ns, timeout_ns, active)
        # Per joint: a gripper published apart from the arm may fall silent alone.
        received = self._joints.received_ns()
        silent = [name for name, r in zip(self.settings.joint_names, received)
                  if now_ns - (r if r is not None else self._activated_ns) > timeout_ns]
        oldest = None if None in received else min(received)
        hint = f"; the latest message named only {list(self._joints.unknown)[:8]}" \
            if self._joints.unknown and len(silent) == len(received) else ""
        self._check_age("joint_states stale", "joint_states", oldest, now_ns, timeout_ns, active,
                        f"no joint state for {silent} for more than {self.settings.input_timeout_s:g} s "
                        f"(input_timeout_s){hint}" if silent else "")

    def _check_age(self, source: str, input_source: str, received: Optional[int], now_ns: int, timeout_ns: int,
                   active: set, reason: str = "") -> None:
        # A broken input already holds with its own reason; silence is reported only for the
        # rest, and only once it lasts longer than the timeout (at start-up too).
        if received is None:
            received = self._activated_ns
        if input_source not in active and now_ns - received > timeout_ns:
            self.faults.set(source, (reason or f"no {input_source} input for more than "
                                               f"{self.settings.input_timeout_s:g} s (input_timeout_s)")
                            + self._silence_hint(input_source))
        elif source in active and now_ns - received <= timeout_ns:
            self.faults.clear(source)

    def _silence_hint(self, input_source: str) -> str:
        """Why a silent input may be silent, from what DDS knows of its publishers."""
        sub = self._inputs[input_source]
        if sub.get_publisher_count() == 0:
            return f"; nothing publishes on {sub.topic_name}"
        hint = f"; {sub.topic_name} has a publisher, but no message arrives"
        if sub.msg_type is Image:
            hint += (": Fast DDS's default transports drop raw frames this large, start the camera publisher with "
                     f"FASTDDS_DEFAULT_PROFILES_FILE={FRAME_TRANSPORT_PROFILE} or use a .../compressed topic")
        return hint

    # -- the control loop -----------------------------------------------------------------------
    def _on_tick(self) -> None:
        started = time.perf_counter()
        self._tick += 1
        now_ns = self._now_ns()
        if self._tick == 1:
            self._activated_ns = now_ns
        if self._timeline_ended.is_set():
            self._timeline_ended.clear()
            self._drop_old_timeline()
        self._check_input_ages(now_ns)
        blocked = self._blocking_cause()
        if blocked is not None and self._blocked is None:
            self._plan.clear()
            self._epoch += 1       # a chunk computed before the hold must not resume it
        self._blocked = blocked
        target = None if blocked else self._plan.action(self._tick)
        self._publish_command(target)
        self._loop_period.add(started)
        self._hold = blocked or (None if target is not None else self._no_plan_cause())
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

    def _no_plan_cause(self) -> str:
        if self._plan.actions is not None:   # there was a plan and it ran out before the next chunk
            self._counts["plan_underruns"] += 1
            self._plan.clear()
            self.get_logger().warning(f"plan ran out before the next chunk: {self._underrun_cause()}",
                                      throttle_duration_sec=5.0)
        if self._wait is not None:
            return self._wait.reason
        return "waiting for a chunk"

    def _underrun_cause(self) -> str:
        """Why the next chunk is not here: the inputs an observation waited for, or inference."""
        request = self._in_flight
        if request is None:
            return f"no observation could be sent: {self._wait.reason}" if self._wait else \
                "no observation was sent since the last chunk"
        if request.late_ticks:
            return f"its observation was sent {request.late_ticks} ticks late: {request.late_because}"
        return (f"inference slower than replan_threshold ticks allow (in flight for {self._tick - request.tick} "
                f"ticks)")

    def _publish_command(self, target: Optional[np.ndarray]) -> None:
        previous = self._last_command
        if previous is None:
            previous = self._joints.newest()
            if previous is None:
                return     # not every joint known yet: publishing anything would be a guess
        if target is not None:
            target = self._post.command(target, self._joints.newest())
        command = self._safety(previous if target is None else target, previous)
        self._last_command = command
        self._command_pub.publish(messages.command_msg(command))
        if self._joint_command_pub is not None:
            self._joint_command_pub.publish(messages.joint_command_msg(self.settings.joint_names, command,
                                                                       self.get_clock().now().to_msg()))

    def _collect(self) -> None:
        """Take the engine's answer, if there is one."""
        if self._engine is None:
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
        request, self._in_flight = self._in_flight, None
        self._ring.unpin()
        if result.kind == "rejected":
            self._counts["rejected"] += 1
            self.faults.set("engine", f"observation rejected by the engine: {result.reason}")
            return
        if result.kind == "failed":
            self.faults.set("engine", f"inference failed: {result.reason}")
            return
        if request.epoch != self._epoch:
            self._counts["discarded"] += 1
            return
        if not np.all(np.isfinite(result.actions)):
            self.faults.set("output", "the chunk has non-finite actions; dropped")
            return
        self.faults.clear("engine")
        self.faults.clear("output")
        self._latency_ticks.add(self._tick - request.tick)
        freeze = int(self._latency_ticks.values().max())
        s = self.settings
        taken = self._plan.hand_over(self._post.chunk(result.actions), request.tick + 1, self._tick, s.handover,
                                     freeze, s.blend_steps, s.average_weight)
        self._record_timing(request, result, arrived)   # the control loop has the chunk (or dropped it)
        if not taken:
            self._counts["late_chunks"] += 1
            self.get_logger().warning(f"chunk arrived {self._tick - request.tick} ticks after its request, after "
                                      "its last action: dropped (inference slower than the horizon)",
                                      throttle_duration_sec=5.0)
            return
        t0 = time.perf_counter()
        self._publish_trajectory()
        self._trajectory_ms.add((time.perf_counter() - t0) * 1e3)
        self._counts["chunks"] += 1

    def _publish_trajectory(self) -> None:
        measured = self._joints.newest()   # the plan's relative moves, against the joints measured now
        targets = np.array([self._post.command(a, measured) for a in self._plan.upcoming(self._tick)])
        commands = self._safety.rollout(targets, self._last_command)
        period_ns = self._control_timer.timer_period_ns
        wait_ns = self._control_timer.time_until_next_call() or 0
        first = self.get_clock().now() + Duration(nanoseconds=wait_ns)
        self._trajectory_pub.publish(messages.trajectory_msg(self.settings.joint_names, commands, first.to_msg(),
                                                             period_ns))

    def _record_timing(self, request: Request, result: Result, arrived: float) -> None:
        for stage in STAGES:
            if stage in result.timings:
                self._stage_ms[stage].add(result.timings[stage])
        self._predict_ms.add(result.predict_ms)
        self._round_trip_ms.add((arrived - request.sent_at) * 1e3)
        # What the node adds to engine.predict() before the chunk is in the plan: choosing and
        # sending the window, the hop to the worker, the worker's wrapping, taking the answer in
        # (not the wait for the next tick, which is scheduling, not work; the trajectory message
        # is built after and timed apart).
        worker_ms = (result.sent_at - result.received_at) * 1e3 - result.predict_ms
        to_worker_ms = (result.received_at - request.sent_at) * 1e3
        take_ms = (time.perf_counter() - arrived) * 1e3
        parts = dict(send=request.send_ms, to_worker=to_worker_ms, worker=worker_ms, take=take_ms)
        for part, ms in parts.items():
            self._overhead_parts_ms[part].add(ms)
        self._overhead_ms.add(sum(parts.values()))
        self._memory = result.memory

    def _dispatch(self, now_ns: int) -> None:
        """Send the newest complete observation when the plan runs low and nothing is in flight."""
        s = self.settings
        if self._in_flight is not None or self._engine is None:
            return
        if self._plan.remaining(self._tick) > s.replan_threshold:
            return
        if self.faults.sources() - RETRY_SOURCES or not s.instruction.strip():
            self._sync_wait_since = self._late_since = None
            return
        t0 = time.perf_counter()
        window = self._ring.take_window(self._observed_state)
        if isinstance(window, Wait):
            self._wait = window
            if self._late_since is None:
                self._late_since = self._tick
            self._watch_sync(window, now_ns)
            return
        late_ticks = self._tick - self._late_since if self._late_since is not None else 0
        late_because = self._wait.reason if late_ticks and self._wait is not None else ""
        self._wait = None
        self._sync_wait_since = self._late_since = None
        self.faults.clear("sync")
        self.faults.clear("clock")
        self.faults.clear("timeline")   # every input of this window arrived after the step
        if self._last_window_seq is not None and window.seq > self._last_window_seq + 1:
            self._counts["observations_dropped"] += window.seq - self._last_window_seq - 1
        self._last_window_seq = window.seq
        request = Request(self._next_request_id, self._tick, self._epoch, window, 0.0, 0.0, late_ticks, late_because)
        self._next_request_id += 1
        try:
            self._engine.submit(request.id, window.slots, window.frame_ids, window.state.astype(np.float32),
                                s.instruction.strip(), window.stamp_ns / 1e9)
        except OSError as e:
            self._ring.unpin()
            self._lost_engine(f"engine process unreachable: {e}")
            return
        request.sent_at = time.perf_counter()
        request.send_ms = (request.sent_at - t0) * 1e3
        self._in_flight = request
        self._counts["requests"] += 1
        if self.get_logger().is_enabled_for(LoggingSeverity.DEBUG):   # what the policy is shown, for replays
            self.get_logger().debug(f"observation {request.id}: frames {window.frame_ids} state "
                                    f"{window.state.tolist()} stamped {window.state_stamps_ns.tolist()}")

    def _observed_state(self, frame_stamp_ns: int) -> tuple[np.ndarray, np.ndarray] | Wait:
        """(positions, their stamps) [joints] for a window whose newest frame has this stamp, or
        why there is none (a Wait: out of step, a fault once it lasts longer than input_timeout_s)."""
        s = self.settings
        if s.state_sync == "frame":
            return self._joints.at(frame_stamp_ns, int(s.state_slop_s * 1e9))
        newest = self._joints.newest()
        if newest is None:
            return Wait("no joint state for every joint of joint_names yet", sync=False, lacks="state")
        return newest, np.zeros(len(newest), np.int64)

    def _watch_sync(self, wait: Wait, now_ns: int) -> None:
        """Inputs out of step are a fault once it lasts longer than input_timeout_s; history
        still filling is not."""
        if not wait.sync:
            self._sync_wait_since = None
            return
        if self._sync_wait_since is None:
            self._sync_wait_since = now_ns
        elif now_ns - self._sync_wait_since > self.settings.input_timeout_s * 1e9:
            self.faults.set("sync", wait.reason)

    def _lost_engine(self, reason: str) -> None:
        self.faults.set("engine", f"engine lost: {reason}")
        self._in_flight = None
        self._ring.unpin()
        self._engine.stop_worker()   # not close(): the frame ring keeps writing into its shared frames
        self._lost, self._engine = self._engine, None
        restart_s = self.settings.engine_restart_s
        if not restart_s:
            self.get_logger().error(f"engine lost: {reason}; cleanup and configure restart it (or set "
                                    "engine_restart_s)")
            return
        self._restart = EngineRestart(due=time.monotonic() + restart_s)
        self._restart_timer = self.create_timer(RESTART_POLL_S, self._step_restart,
                                                clock=Clock(clock_type=ClockType.STEADY_TIME))
        self.get_logger().error(f"engine lost: {reason}; restarting it in {restart_s:g} s (engine_restart_s)")

    def _step_restart(self) -> None:
        """Respawn the lost engine when due, then poll it until warm (never blocking the executor),
        then hand it the frame buffer the node kept writing. Resumes like a fresh activation: the
        next window goes out once the inputs are fresh."""
        r, s = self._restart, self.settings
        retry_s = max(s.engine_restart_s, RESTART_POLL_S)   # also if it was set to 0 meanwhile
        if not r.spawned:
            if time.monotonic() < r.due:
                return
            self.get_logger().info(f"restarting the engine (attempt {r.attempt})")
            self._lost.options["action_cache"] = self._schedule_accepted
            self._lost.spawn(s.engine_start_timeout_s)
            r.spawned = True
        try:
            info = self._lost.check_ready(self.get_logger().info)
            if info is not None:
                self._lost.send_frames()
        except (EngineError, OSError) as e:
            self._lost.stop_worker()
            self.faults.set("engine", f"engine restart failed: {e}; retrying every {retry_s:g} s")
            r.attempt, r.due, r.spawned = r.attempt + 1, time.monotonic() + retry_s, False
            return
        if info is None:
            return
        self._engine, self._info, self._lost = self._lost, info, None
        self._end_restart()
        self._engine_restarts += 1
        self._epoch += 1     # nothing sent to the old worker is waited for
        self.get_logger().info(f"engine restarted: {info.description}, engine process {info.pid}")
        self.faults.clear("engine")
        if self.settings.action_cache != self._schedule_accepted:
            self._engine.set_action_cache(self.settings.action_cache)

    def _end_restart(self) -> None:
        """Stop restarting: done, or cleanup (which then ends a worker still starting)."""
        if self._restart_timer is not None:
            self.destroy_timer(self._restart_timer)
            self._restart_timer = None
        self._restart = None

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
        names = {p.name for p in changes}
        if "use_sim_time" in names and self._control_timer is not None:
            self.destroy_timer(self._control_timer)
            self._control_timer = self._make_control_timer()
            self._loop_period.clear()
        elif new.control_rate_hz != old.control_rate_hz and self._control_timer is not None:
            self._control_timer.timer_period_ns = int(new.control_period_s * 1e9)
            self._loop_period.clear()
        if names & {"joint_lower_limits", "joint_upper_limits", "max_step_per_tick"}:
            self._safety = self._make_safety()
        if names & {"postprocess", "max_joint_delta_scale"}:
            self._post = self._make_post()
        if "instruction" in names:
            self.faults.clear("instruction")
        if names & {"sync_slop_s", "state_slop_s", "wait_for_history"} and self._ring is not None:
            self._ring.spec = self._window_spec()
        if "action_cache" in names and self._engine is not None and new.action_cache != self._schedule_accepted:
            self._engine.set_action_cache(new.action_cache)

    def _schedule_answer(self, result: Result) -> None:
        """params.validate already refused malformed schedules; the engine checks again against
        the checkpoint's own flow steps, in its process (the control loop does not wait): a
        schedule it still refuses is reported and the parameter set back."""
        if not result.reason:
            self._schedule_accepted = self.settings.action_cache
            self.get_logger().info(f"action_cache {self._schedule_accepted!r} in effect")
            return
        self.get_logger().error(f"action_cache {self.settings.action_cache!r} refused by the engine: "
                                f"{result.reason}; restored {self._schedule_accepted!r}")
        self.set_parameters([Parameter("action_cache", Parameter.Type.STRING, self._schedule_accepted)])

    def _make_post(self) -> PostProcess:
        s = self.settings
        if s.postprocess == "none" or self._info is None:
            return PostProcess()
        return PostProcess.of(self._info.robot, s.max_joint_delta_scale)

    def _make_safety(self) -> SafetyFilter:
        s = self.settings
        return SafetyFilter(s.joint_lower_limits, s.joint_upper_limits, s.max_step_per_tick)

    # -- diagnostics ----------------------------------------------------------------------------
    def _now_ns(self) -> int:
        return self.get_clock().now().nanoseconds

    def _on_diagnostics_timer(self) -> None:
        """Diagnostics when no control tick sends them (inactive, or a paused simulation)."""
        self.faults.flush()
        if self._loop_period.newest() is None or time.perf_counter() - self._loop_period.newest() > 0.5:
            self._publish_diagnostics()

    def _publish_diagnostics(self) -> None:
        status = DiagnosticStatus(name="vla_node: policy", hardware_id=self.get_fully_qualified_name())
        faults = self.faults.active()
        if self._configure_error and self._state == "unconfigured":
            status.level, status.message = DiagnosticStatus.ERROR, f"configure failed: {self._configure_error}"
        elif faults:
            status.level = DiagnosticStatus.ERROR
            status.message = "holding: " + "; ".join(f"{k}: {v}" for k, v in sorted(faults.items()))
        elif self._state != "active":
            status.level, status.message = DiagnosticStatus.WARN, f"holding: {self._state}"
        elif self._hold is not None:
            status.level, status.message = DiagnosticStatus.WARN, f"holding: {self._hold}"
        else:
            status.level, status.message = DiagnosticStatus.OK, "running"
        status.values = key_values(self._diagnostic_values(faults))
        msg = DiagnosticArray(status=[status])
        msg.header.stamp = self.get_clock().now().to_msg()
        self._diagnostics_pub.publish(msg)
        self._diagnostics_sent = time.monotonic()

    def _diagnostic_values(self, faults: dict) -> list:
        s = self.settings
        values = [("state", self._state), ("hold", self._hold or "no"),
                  ("faults", "; ".join(f"{k}: {v}" for k, v in sorted(faults.items())) or "none"),
                  ("holds_by_cause", ", ".join(f"{k}={n}" for k, n in sorted(self.faults.events.items())) or "none")]
        if self._configure_error:
            values.append(("configure_error", self._configure_error))
        if self._info is not None:
            values += [("engine", self._info.description),
                       ("engine_pid", self._info.pid if self._engine is not None else "none (lost)"),
                       ("horizon", self._info.horizon)]
        if self._restart is not None:
            values.append(("engine_restart", f"attempt {self._restart.attempt}"))
        values.append(("engine_restarts", self._engine_restarts))
        values += [("control_rate_hz", s.control_rate_hz), ("ticks", self._tick)]
        values += self._loop_pairs()
        for stage in STAGES:
            values += percentile_pairs(f"engine_{stage}", self._stage_ms[stage])
        values += percentile_pairs("engine_predict", self._predict_ms)
        values += percentile_pairs("round_trip", self._round_trip_ms)
        values += percentile_pairs("node_overhead", self._overhead_ms)
        for part, rolling in self._overhead_parts_ms.items():
            values += percentile_pairs(f"node_overhead_{part}", rolling)
        values += percentile_pairs("trajectory_publish", self._trajectory_ms)
        values += percentile_pairs("frame_ingest", self._ingest_ms)
        if len(self._latency_ticks):
            values.append(("latency_ticks_max", int(self._latency_ticks.values().max())))
        values += list(self._counts.items())
        if self._decoder is not None:
            values.append(("frames_dropped_unconverted", self._decoder.dropped))
        values += self._age_pairs()
        if self._memory is not None:
            values += [("gpu_memory_allocated_mib", self._memory[0] / 2**20),
                       ("gpu_memory_reserved_mib", self._memory[1] / 2**20)]
        else:
            values.append(("gpu_memory", f"n/a (device {s.device})"))
        return values

    def _loop_pairs(self) -> list:
        if len(self._loop_period) < 3:
            return [("command_period_ms", "no data")]
        periods = np.diff(self._loop_period.values()) * 1e3
        pairs = [("command_period_ms_p50", float(np.percentile(periods, 50)))]
        if not self._sim_time():
            jitter = np.abs(periods - self.settings.control_period_s * 1e3)
            q = np.percentile(jitter, [50, 99])
            pairs += [("command_jitter_ms_p50", float(q[0])), ("command_jitter_ms_p99", float(q[1])),
                      ("command_jitter_ms_max", float(jitter.max()))]
        return pairs

    def _age_pairs(self) -> list:
        if self._ring is None:
            return []
        now = self._now_ns()
        pairs = []
        for name, received in zip(self.settings.camera_names, self._ring.newest_received_ns()):
            pairs.append((f"input_age_s.{name}", (now - received) / 1e9 if received is not None else "never"))
        received = self._joints.received_ns()   # the joint heard from longest ago
        pairs.append(("input_age_s.joint_states", (now - min(received)) / 1e9 if None not in received else "never"))
        return pairs


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
