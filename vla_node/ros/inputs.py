"""The node's inputs, from configure to cleanup: camera frames (converted off the executor into
the frame ring the engine reads), joint states assembled per joint, the instruction and the
e-stop; their health as hold causes; and the newest complete window of them for the engine.
"""
from __future__ import annotations

import threading
import time
from typing import Optional

import numpy as np
from rclpy.event_handler import SubscriptionEventCallbacks
from rclpy.parameter import Parameter
from rclpy.qos import qos_profile_sensor_data
from rclpy.subscription import Subscription
from sensor_msgs.msg import CompressedImage, Image, JointState
from std_msgs.msg import Bool, String

from ..runtime import images
from ..runtime.timeline import Change
from ..runtime.windows import InputError, Wait, WindowSpec, frames_to_keep
from . import FRAME_TRANSPORT_PROFILE, messages
from .context import NodeContext
from .diagnostics import FaultSource, Key, duration_in_words
from .engine_process import EngineProcess
from .frames import FrameRing, SharedInputs, Window

DRAIN_TIMEOUT_S = 10.0   # Decoder.drain: a conversion takes milliseconds; this only bounds the wait


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
        self._converting = False
        self._stop = False
        self.dropped = 0
        self._thread = threading.Thread(target=self._run, name="vla_node_decoder", daemon=True)
        self._thread.start()

    def push(self, camera: int, msg: Image | CompressedImage, arrived_ns: int) -> None:
        with self._wake:
            self.dropped += camera in self._pending
            self._pending[camera] = (msg, arrived_ns)   # a replaced entry keeps its place in the queue
            self._wake.notify_all()

    def drain(self, timeout_s: float = DRAIN_TIMEOUT_S) -> None:
        """Until every frame pushed so far is converted (fixed_latency_s: a control tick sees every
        frame that arrived before it, however busy the machine)."""
        with self._wake:
            self._wake.wait_for(lambda: not self._pending and not self._converting, timeout_s)

    def _run(self) -> None:
        while True:
            with self._wake:
                self._converting = False
                self._wake.notify_all()
                self._wake.wait_for(lambda: self._pending or self._stop)
                if self._stop:
                    return
                camera = next(iter(self._pending))
                msg, arrived_ns = self._pending.pop(camera)
                self._converting = True
            fill = images.compressed_into if isinstance(msg, CompressedImage) else images.image_into
            self._ingest(camera, msg, arrived_ns, fill)

    def close(self) -> None:
        with self._wake:
            self._stop = True
            self._wake.notify()
        self._thread.join()


def silence_hint(topic: str, publishers: int, lost_since_newest: bool, raw_image: bool) -> str:
    """What DDS knows of why an input is silent: nothing publishes on it, or messages were lost on
    their way since its newest one arrived (its subscription's message-lost events). A publisher
    that has not sent yet (vla-replay live before it plays, a driver starting up) and a gap in a
    stream are not the transport's doing: nothing is added for them."""
    if publishers == 0:
        return f"; nothing publishes on {topic}"
    if not lost_since_newest:
        return ""
    hint = f"; {topic} has a publisher, but its messages are lost on the way"
    if raw_image:
        hint += (": Fast DDS's default transports drop raw frames this large, start the camera publisher with "
                 f"FASTDDS_DEFAULT_PROFILES_FILE={FRAME_TRANSPORT_PROFILE} or use a .../compressed topic")
    return hint


class Inputs:
    """The subscriptions of a configured node and what they feed. Faults go to node.faults by
    source ("camera 'exo'", "joint_states", "instruction", "estop", "sync", "timeline" and
    "<input> stale"); the parameters are read from node.settings when used.

    The frames live in `engine`'s shared frames (frames.SharedInputs: an InputTimeline over a
    FrameRing); they hold the history span, whose length in time (`offset_s` between frame times)
    the checkpoint decides."""

    def __init__(self, ctx: NodeContext, engine: EngineProcess, offset_s: float):
        self._ctx, self._telemetry, self.offset_s = ctx, ctx.telemetry, offset_s
        node, s = ctx.ros, ctx.settings
        keep = frames_to_keep(s.history_frames, offset_s, s.max_camera_rate_hz)
        shape = FrameRing.shape_of(len(s.camera_names), s.camera_height, s.camera_width, keep, s.history_frames)
        self.shared = SharedInputs(list(s.camera_names), s.joint_names, s.camera_height, s.camera_width,
                                   self.window_spec(), keep, engine.share_frames(shape), s.state_sync)
        self.joints = self.shared.joints            # recent samples per joint, by header stamp
        self.timeline_ended = threading.Event()     # the inputs' timeline changed: the control loop resets
        self.decoder = Decoder(self._ingest)
        self._subs: dict[str, Subscription] = {}   # by fault source
        self._lost_ns: dict[str, int] = {}          # by fault source: when DDS last reported messages lost
        for i, topic in enumerate(s.camera_topics):
            kind = CompressedImage if topic.rstrip("/").endswith("/compressed") else Image
            self._subs[self._camera(i)] = node.create_subscription(
                kind, topic, lambda m, i=i: self.decoder.push(i, m, ctx.now_ns()), qos_profile_sensor_data,
                event_callbacks=self._losses(self._camera(i)))
        joints = FaultSource.JOINT_STATES
        self._subs[joints] = node.create_subscription(JointState, s.joint_states_topic, self._on_joint_state,
                                                      qos_profile_sensor_data, event_callbacks=self._losses(joints))
        self._subs[FaultSource.INSTRUCTION] = node.create_subscription(String, s.instruction_topic,
                                                                       self._on_instruction, 10)
        self._subs[FaultSource.ESTOP] = node.create_subscription(Bool, s.estop_topic, self._on_estop, 10)
        self.reset()

    def reset(self) -> None:
        """At each activation (and deactivation): silence counts from the first control tick."""
        self._since_ns: Optional[int] = None        # the first control tick's time
        self._sync_wait_since: Optional[int] = None
        self._last_window_seq: Optional[int] = None
        self.shared.unpin()

    def window_spec(self) -> WindowSpec:
        """Which frames make a window, from the parameters (sync_slop_s, state_slop_s and
        wait_for_history change at run time: configure() applies them)."""
        s = self._ctx.settings
        return WindowSpec.of(s.history_frames, self.offset_s, s.sync_slop_s, s.state_slop_s, s.wait_for_history)

    def configure(self) -> None:
        """The run-time parameters that shape windows changed."""
        self.shared.configure(self.window_spec(), self._ctx.settings.state_sync)

    def close(self) -> None:
        for sub in self._subs.values():
            self._ctx.ros.destroy_subscription(sub)
        self._subs = {}
        self.decoder.close()

    def _losses(self, input_source: str) -> SubscriptionEventCallbacks:
        return SubscriptionEventCallbacks(message_lost=lambda _: self._on_message_lost(input_source))

    def _camera(self, camera: int) -> str:
        return FaultSource.camera(self._ctx.settings.camera_names[camera])

    # -- callbacks ------------------------------------------------------------------------------
    def _ingest(self, camera: int, msg, arrived_ns: int, fill) -> None:
        """Store one camera frame (on the decoder thread)."""
        t0 = time.perf_counter()
        stamp = messages.stamp_ns(msg.header.stamp)
        try:
            change = self.shared.write(camera, stamp, arrived_ns, lambda out: fill(msg, out))
        except InputError as e:
            self._ctx.faults.set(self._camera(camera), str(e))
            return
        if change is not None:   # the first frame of a new timeline: the old one is forgotten, this one kept
            self._end_timeline(change)
        self._telemetry.ingest_ms.add((time.perf_counter() - t0) * 1e3)
        self._ctx.faults.clear(self._camera(camera))

    def _on_joint_state(self, msg: JointState) -> None:
        """Samples of the configured joints, however the drivers split them into messages; a
        message naming none of them (another robot part's driver) is not an error."""
        stamp, now = messages.stamp_ns(msg.header.stamp), self._ctx.now_ns()
        try:
            named, change = self.shared.add_joint_states(stamp, msg.name, msg.position, now)
        except InputError as e:
            self._ctx.faults.set(FaultSource.JOINT_STATES, str(e))
            return
        if change is not None:   # the first message of a new timeline: the old one is forgotten, this one kept
            self._end_timeline(change)
        if named:
            self._ctx.faults.clear(FaultSource.JOINT_STATES)

    def _end_timeline(self, change: Change) -> None:
        """The inputs' timeline changed (any thread; runtime/timeline.py says when): a recorded
        simulation reset, an NTP step, a restarted driver, two recordings interleaved. Every
        stored frame and joint state of the old timeline is forgotten already; the control loop
        drops the plan and the chunk in flight on its next tick. Observations resume with inputs
        all of the new timeline."""
        self.timeline_ended.set()
        if not change.announce:    # back to the timeline before a step: that step's fault stands
            return
        by = f" by {duration_in_words(change.back_ns / 1e9)}" if change.back_ns else ""
        self._ctx.faults.set(FaultSource.TIMELINE, f"{change.reason}{by}: inputs and plan discarded, resuming "
                                                   "with inputs of the new timeline")

    def forget(self) -> None:
        """Every stored frame and joint state, and the stamps they had (the clock jumped back)."""
        self.shared.forget()

    def _on_instruction(self, msg: String) -> None:
        text = msg.data.strip()
        if not text:
            topic = self._subs[FaultSource.INSTRUCTION].topic_name
            self._ctx.faults.set(FaultSource.INSTRUCTION, f"empty instruction on {topic}; holding until a non-empty "
                                                          "one arrives")
            return
        result = self._ctx.ros.set_parameters([Parameter("instruction", Parameter.Type.STRING, text)])[0]
        if not result.successful:
            self._ctx.faults.set(FaultSource.INSTRUCTION, f"instruction refused: {result.reason}")

    def _on_estop(self, msg: Bool) -> None:
        if msg.data:
            self._ctx.faults.set(FaultSource.ESTOP, f"e-stop engaged on {self._subs[FaultSource.ESTOP].topic_name}")
        else:
            self._ctx.faults.clear(FaultSource.ESTOP)

    # -- on the control loop --------------------------------------------------------------------
    def check(self, now_ns: int) -> bool:
        """Every input silent for longer than input_timeout_s holds, with what DDS knows of why;
        True once after the inputs' timeline changed (the control loop drops the plan then). With
        fixed_latency_s, every frame that arrived before the tick is converted first
        (reproducible)."""
        if self._ctx.settings.fixed_latency_s:
            self.decoder.drain()
        changed = self.timeline_ended.is_set()
        if changed:
            self.timeline_ended.clear()
        self._check_silence(now_ns)
        return changed

    def measured(self) -> Optional[np.ndarray]:
        """[joints] each joint's newest position; None until every joint has one."""
        return self.joints.newest()

    def _check_silence(self, now_ns: int) -> None:
        s, faults = self._ctx.settings, self._ctx.faults
        if self._since_ns is None:
            self._since_ns = now_ns
        timeout_ns = int(s.input_timeout_s * 1e9)
        active = faults.sources()
        for camera, received in enumerate(self.shared.newest_received_ns()):
            source = self._camera(camera)
            self._check_age(FaultSource.stale(source), source, received, now_ns, timeout_ns, active)
        # Per joint: a gripper published apart from the arm may fall silent alone.
        received = self.joints.received_ns()
        silent = [name for name, r in zip(s.joint_names, received)
                  if now_ns - (r if r is not None else self._since_ns) > timeout_ns]
        oldest = None if None in received else min(received)
        hint = f"; the latest message named only {list(self.joints.unknown)[:8]}" \
            if self.joints.unknown and len(silent) == len(received) else ""
        joints = FaultSource.JOINT_STATES
        self._check_age(FaultSource.stale(joints), joints, oldest, now_ns, timeout_ns, active,
                        f"no joint state for {silent} for more than {s.input_timeout_s:g} s "
                        f"(input_timeout_s){hint}" if silent else "")

    def _check_age(self, source: str, input_source: str, received: Optional[int], now_ns: int, timeout_ns: int,
                   active: set, reason: str = "") -> None:
        # A broken input already holds with its own reason; silence is reported only for the
        # rest, and only once it lasts longer than the timeout (at start-up too).
        faults = self._ctx.faults
        if received is None:
            received = self._since_ns
        if input_source not in active and now_ns - received > timeout_ns:
            sub, lost_ns = self._subs[input_source], self._lost_ns.get(input_source)
            faults.set(source, (reason or f"no {input_source} input for more than "
                                          f"{self._ctx.settings.input_timeout_s:g} s (input_timeout_s)")
                       + silence_hint(sub.topic_name, sub.get_publisher_count(),
                                      lost_ns is not None and lost_ns > received, sub.msg_type is Image))
        elif source in active and now_ns - received <= timeout_ns:
            faults.clear(source)

    def _on_message_lost(self, input_source: str) -> None:
        """DDS dropped messages of this input on their way (Fast DDS's default transports do so
        with large raw frames)."""
        self._lost_ns[input_source] = self._ctx.now_ns()

    def take_window(self, now_ns: int) -> Window | Wait:
        """The newest complete window (its frames pinned until release_window()), or why there is
        none. Inputs out of step are a fault once it lasts longer than input_timeout_s; history
        still filling is not."""
        window = self.shared.take_window()
        faults = self._ctx.faults
        if isinstance(window, Wait):
            if not window.sync:
                self._sync_wait_since = None
            elif self._sync_wait_since is None:
                self._sync_wait_since = now_ns
            elif now_ns - self._sync_wait_since > self._ctx.settings.input_timeout_s * 1e9:
                faults.set(FaultSource.SYNC, window.reason)
            return window
        self._sync_wait_since = None
        faults.clear(FaultSource.SYNC)
        faults.clear(FaultSource.CLOCK)
        faults.clear(FaultSource.TIMELINE)   # every input of this window arrived after the step
        if self._last_window_seq is not None and window.seq > self._last_window_seq + 1:
            self._telemetry.counts[Key.OBSERVATIONS_DROPPED] += window.seq - self._last_window_seq - 1
        self._last_window_seq = window.seq
        return window

    def release_window(self) -> None:
        """The engine has answered (or lost) the window taken last: its frames may be reused."""
        self.shared.unpin()

    def not_sending(self) -> None:
        """A fault holds observations too: being out of step is not timed meanwhile."""
        self._sync_wait_since = None

    def pairs(self, now_ns: int) -> list[tuple[str, object]]:
        """/diagnostics values: frames the decoder dropped, and the seconds since each camera's
        and the joint states' newest input."""
        pairs: list[tuple[str, object]] = [(Key.FRAMES_DROPPED_UNCONVERTED, self.decoder.dropped)]
        for name, received in zip(self._ctx.settings.camera_names, self.shared.newest_received_ns()):
            pairs.append((Key.input_age(name), (now_ns - received) / 1e9 if received is not None else "never"))
        received = self.joints.received_ns()   # the joint heard from longest ago
        pairs.append((Key.input_age("joint_states"),
                      (now_ns - min(received)) / 1e9 if None not in received else "never"))
        return pairs
