"""Live replay: a bag's camera / joint-state / instruction messages published into a running
vla_node in recorded timing, everything the node publishes recorded into a new bag, a summary.

Two processes, so that measuring disturbs the measurement as little as possible: the player
(a child process) converts and publishes the bag's messages on schedule and, for a node with
use_sim_time, publishes /clock from the bag's time; the recorder (this process) only receives
and writes. In one process the player's Python work would delay the recorder's callbacks by up
to the GIL's 5 ms switch interval, which is larger than the command jitter being measured.

Time: with /clock the node's clock is the bag's time and header stamps stay as recorded: the
bag's own /clock messages when it has them (a recorded simulation, resets included), else a
clock made from the bag's log times. Without /clock, header stamps are shifted to the wall-clock
time of playback, so the node sees fresh inputs and a second replay into the same node still has
increasing stamps. The recording is on the bag's log-time base with /clock (the node's time,
unless the bag's own clock steps back), on the node's wall clock without.
"""
from __future__ import annotations

import ast
import importlib
import json
import multiprocessing as mp
import os
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from ..ros.diagnostics import STAGES, Key
from ..runtime.windows import InputError, reorder_joints
from .bag_io import (
    CLOCK,
    CLOCK_TOPIC,
    COMPRESSED_IMAGE,
    COMPRESSED_SUFFIX,
    DIAGNOSTIC_ARRAY,
    FLOAT64_MULTI_ARRAY,
    IMAGE,
    JOINT_STATE,
    JOINT_TRAJECTORY,
    STRING,
    TYPESTORE,
    Bag,
    BagError,
    BagWriter,
    canonical_cdr,
    compressed_image_msg,
    decode_image,
    image_msg,
    resolve_inputs,
    stamp_ns,
    time_msg,
)
from .node_process import FRAME_TRANSPORT_PROFILE
from .stats import summary

Progress = Callable[[str], None]


class LiveError(RuntimeError):
    """The node under test or the replay's own processes did not do what a replay needs."""


# The node's parameters the replay adapts to.
NODE_PARAMETERS = ("camera_names", "camera_topics", "joint_names", "joint_states_topic", "instruction_topic",
                   "control_rate_hz", "replan_threshold", "input_timeout_s", "use_sim_time")
LOG = "rcl_interfaces/msg/Log"
PARAMETER_EVENT = "rcl_interfaces/msg/ParameterEvent"
START_LEAD_S = 0.2     # playback starts this long after the go: both processes agree on t0
# A service sends its response only to a client whose response reader it has matched, after waiting
# 100 ms for it (rmw_fastrtps): on a loaded machine discovery can take longer and the response is
# lost, even after service_is_ready. Read-only requests are sent again after this long.
RESEND_S = 5.0


def ros_type(msgtype: str):
    """'pkg/msg/Name' -> the rclpy message class."""
    package, _, name = msgtype.split("/")
    return getattr(importlib.import_module(f"{package}.msg"), name)


# -- the plan, shared with the player process ----------------------------------------------------
@dataclass(frozen=True)
class Route:
    """One bag topic into one node input."""
    bag_topic: str
    bag_type: str
    node_topic: str
    node_type: str
    latched: bool = False       # the instruction: a late-joining subscriber still gets it


@dataclass(frozen=True)
class PlaybackPlan:
    bag: Path
    routes: tuple[Route, ...]
    rate: float
    clock_hz: float             # /clock rate made during pre-roll, and from log times in playback; 0: no /clock
    bag_clock: bool             # /clock is the bag's own, played as recorded
    restamp: bool               # shift header stamps to the wall-clock time of playback
    instruction: Optional[str]  # published once on instruction_topic instead of the bag's
    instruction_topic: str
    tail_s: float
    wait_s: float
    joint_names: tuple[str, ...]   # the node's joint order (for the summary's plot of what was played)


@dataclass
class LiveOptions:
    bag: Path
    rate: float = 1.0
    clock: str = "auto"                           # auto (the node's use_sim_time) | on | off
    clock_hz: float = 0.0                         # 0: max(100, 4 x the node's control rate)
    node: str = "/vla_node"
    out: Path = Path("out/replay_live")
    storage: str = "mcap"
    wait_s: float = 60.0
    tail_s: float = 1.0
    # The bag's topics; None: the node's own topic names.
    camera_topics: Optional[Sequence[str]] = None
    joint_states: Optional[str] = None
    instruction_topic: Optional[str] = None
    instruction: Optional[str] = None             # text instead of the bag's instruction topic
    # Called while waiting: a reason to stop waiting (e.g. the node's process exited), or None.
    abort_if: Optional[Callable[[], Optional[str]]] = None


def plan_playback(bag: Bag, params: dict, options: LiveOptions, clock_on: bool, fqn: str) -> PlaybackPlan:
    """Match the bag's topics to the inputs of the node `fqn`; clear errors when the bag cannot
    feed them. The node's relative topic names are its namespace's; in the bag they are looked
    up as a robot without a namespace records them (/joint_states, ...) unless options name them."""
    from rclpy.expand_topic_name import expand_topic_name

    name, namespace = _split_name(fqn)

    def node_topic(topic: str) -> str:
        return expand_topic_name(topic, name, namespace)

    def bag_topic(topic: str) -> str:
        return expand_topic_name(topic, name, "/")

    inputs = resolve_inputs(bag, params["camera_names"],
                            options.camera_topics or [bag_topic(t) for t in params["camera_topics"]],
                            options.joint_states or bag_topic(params["joint_states_topic"]),
                            None if options.instruction else
                            options.instruction_topic or bag_topic(params["instruction_topic"]),
                            reference=None)
    node_cameras = [node_topic(t) for t in params["camera_topics"]]
    routes = [Route(c.topic, c.msgtype, camera,
                    COMPRESSED_IMAGE if camera.rstrip("/").endswith(COMPRESSED_SUFFIX) else IMAGE)
              for c, camera in zip(inputs.cameras, node_cameras)]
    routes.append(Route(inputs.joint_states, JOINT_STATE, node_topic(params["joint_states_topic"]), JOINT_STATE))
    instruction_topic = node_topic(params["instruction_topic"])
    if inputs.instruction:
        routes.append(Route(inputs.instruction, STRING, instruction_topic, STRING, latched=True))
    bag_clock = clock_on and bag.topics.get(CLOCK_TOPIC) == CLOCK
    if bag_clock:
        routes.append(Route(CLOCK_TOPIC, CLOCK, CLOCK_TOPIC, CLOCK))
    clock_hz = options.clock_hz or max(100.0, 4 * params["control_rate_hz"])
    return PlaybackPlan(bag=options.bag, routes=tuple(routes), rate=options.rate,
                        clock_hz=clock_hz if clock_on else 0.0, bag_clock=bag_clock,
                        restamp=not clock_on,
                        instruction=options.instruction, instruction_topic=instruction_topic,
                        tail_s=options.tail_s, wait_s=options.wait_s, joint_names=tuple(params["joint_names"]))


# The line EngineLink.send logs at debug level (--log-level vla_node:=debug): what the policy was shown.
_OBSERVATION_LINE = re.compile(r"observation (\d+): frames (\[.*?\]) state (\[.*?\]) stamped (\[.*?\])$")


def logged_observations(log_text: str, bag_stamps: Iterable[int]) -> tuple[list, int]:
    """The observations a node logged while this replay (without /clock, rate 1) fed it, on the
    bag's stamps: [(frame ids, state, state stamps)], and how many of them support the shift. The
    player shifted every header stamp by one constant, taken as the one that maps the most newest
    first-camera frames (frame ids[-2], two cameras) onto `bag_stamps`."""
    observations = []
    for line in log_text.splitlines():
        match = _OBSERVATION_LINE.search(line)
        if match:
            frames, state, stamps = (ast.literal_eval(match.group(k)) for k in (2, 3, 4))
            observations.append((frames, np.array(state), np.array(stamps)))
    bag_stamps = list(bag_stamps)
    shifts = Counter(frames[-2][1] - stamp for frames, _, _ in observations for stamp in bag_stamps)
    shift, hits = shifts.most_common(1)[0] if shifts else (0, 0)
    return [([(camera, t - shift) for camera, t in frames], state, stamps - shift)
            for frames, state, stamps in observations], hits


# -- the player (child process) ------------------------------------------------------------------
def convert(route: Route, raw: bytes, shift_ns: Optional[int]) -> bytes:
    """The bag's bytes as the node's input type, header stamp shifted by shift_ns (None: as is). An
    unset stamp (0) stays unset: shifted, it would look like a real one."""
    if route.bag_type == route.node_type and shift_ns is None or route.node_type in (STRING, CLOCK):
        return raw
    msg = TYPESTORE.deserialize_cdr(raw, route.bag_type)
    stamp = stamp_ns(msg.header.stamp)
    stamp += (shift_ns or 0) if stamp else 0
    if route.bag_type != route.node_type:
        rgb = decode_image(msg, route.bag_topic)
        make = image_msg if route.node_type == IMAGE else compressed_image_msg
        msg = make(rgb, stamp, msg.header.frame_id)
    else:
        msg.header.stamp = time_msg(stamp)
    return bytes(TYPESTORE.serialize_cdr(msg, route.node_type))


def play(plan: PlaybackPlan, conn) -> None:
    """Child process. Reports ('ready', unmatched topics) once its publishers see the node's
    subscriptions; on ('preroll',) publishes the bag's first joint state (and /clock) until the
    node shows it hears it; on ('go', start wall ns) plays the bag and reports ('done', report)."""
    import rclpy

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("vla_replay_player", context=context, start_parameter_services=False)
    try:
        player = Player(node, plan)
        conn.send(("ready", player.wait_for_subscribers()))
        if conn.recv()[0] != "preroll":
            return
        start_wall_ns = player.preroll(conn)
        conn.send(("done", player.play(start_wall_ns)))
    except Exception as err:   # the parent reports it; a traceback in a child process helps nobody
        conn.send(("error", f"{type(err).__name__}: {err}"))
    finally:
        node.destroy_node()
        rclpy.try_shutdown(context=context)


class Player:
    # Pre-roll /clock runs up to the bag's start from this far before it, then waits there: the
    # node's timers tick during the handshake and time never jumps back.
    PREROLL_CLOCK_S = 10.0
    PREROLL_PERIOD_S = 0.05

    def __init__(self, node, plan: PlaybackPlan):
        from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy

        self.plan = plan
        reliable = QoSProfile(depth=10, reliability=ReliabilityPolicy.RELIABLE)
        latched = QoSProfile(depth=1, reliability=ReliabilityPolicy.RELIABLE,
                             durability=DurabilityPolicy.TRANSIENT_LOCAL)
        self.routes = {r.bag_topic: r for r in plan.routes}
        self.publishers = {r.bag_topic: node.create_publisher(ros_type(r.node_type), r.node_topic,
                                                              latched if r.latched else reliable)
                           for r in plan.routes}
        self.instruction_pub = (node.create_publisher(ros_type(STRING), plan.instruction_topic, latched)
                                if plan.instruction else None)
        # What rclpy's TimeSource subscribes with.
        self.clock_pub = (node.create_publisher(ros_type(CLOCK), "/clock",
                                                QoSProfile(depth=1, reliability=ReliabilityPolicy.BEST_EFFORT))
                          if plan.clock_hz and not plan.bag_clock else None)
        self.joint_route = next(r for r in plan.routes if r.node_type == JOINT_STATE)
        with Bag(plan.bag) as bag:
            self.bag_start = bag.start_ns
            self.first_joint_states = self._first_joint_states(bag)
            first_clock = next((raw for _, _, _, raw in bag.messages([CLOCK_TOPIC])), None) if plan.bag_clock else None
        # Pre-roll /clock runs up to where playback's clock starts: the bag's own first value, or its start.
        self.clock_start = stamp_ns(TYPESTORE.deserialize_cdr(first_clock, CLOCK).clock) if first_clock else \
            self.bag_start
        self.preroll_clock_pub = self.publishers[CLOCK_TOPIC] if plan.bag_clock else self.clock_pub
        self.preroll_perf = time.perf_counter()
        self.start_perf: Optional[float] = None

    def _first_joint_states(self, bag: Bag, scan: int = 1000) -> list[bytes]:
        """The bag's first joint state messages, as many as name every joint the node uses (the
        arm and the gripper may come in separate messages)."""
        found, missing = [], set(self.plan.joint_names)
        for _, _, _, raw in bag.messages([self.joint_route.bag_topic]):
            names = set(TYPESTORE.deserialize_cdr(raw, JOINT_STATE).name)
            if names & missing or not found:
                found.append(raw)
                missing -= names
            scan -= 1
            if not missing or not scan:
                break
        return found

    def wait_for_subscribers(self) -> list[str]:
        """Topics the node has not subscribed to within wait_s (none, normally)."""
        waiting = {**{r.node_topic: self.publishers[r.bag_topic] for r in self.plan.routes},
                   **({self.plan.instruction_topic: self.instruction_pub} if self.instruction_pub else {}),
                   **({"/clock": self.clock_pub} if self.clock_pub else {})}
        deadline = time.monotonic() + self.plan.wait_s
        while time.monotonic() < deadline and any(p.get_subscription_count() == 0 for p in waiting.values()):
            time.sleep(0.05)   # discovery runs in DDS threads: poll it, for a bounded time
        return sorted(t for t, p in waiting.items() if p.get_subscription_count() == 0)

    def clock_ns(self, perf: float) -> int:
        """The node's clock with /clock: up to playback's first clock value during pre-roll, the
        bag's time after (when the clock is made from log times)."""
        if self.start_perf is None or perf < self.start_perf:
            rise = (perf - self.preroll_perf - self.PREROLL_CLOCK_S) * self.plan.rate
            return self.clock_start + min(0, int(rise * 1e9))
        return self.bag_start + int((perf - self.start_perf) * self.plan.rate * 1e9)

    def preroll(self, conn) -> int:
        """Our publishers matching the node's subscriptions does not mean the node matched ours
        yet: until the parent has seen the node react (it commands once it has every joint),
        publish the bag's first joint states (their recorded stamps with /clock). Returns the
        go's start time (wall ns)."""
        self.preroll_perf = time.perf_counter()
        next_tick = self.preroll_perf
        start_wall_ns = None
        while self.start_perf is None or time.perf_counter() < self.start_perf:
            if start_wall_ns is None and conn.poll():
                command, start_wall_ns = conn.recv()
                if command != "go":
                    raise LiveError(f"unexpected {command!r} during pre-roll")
                self.start_perf = time.perf_counter() + (start_wall_ns - time.time_ns()) / 1e9
            now = time.perf_counter()
            if now >= next_tick:
                if self.preroll_clock_pub is not None:
                    self.preroll_clock_pub.publish(ros_type(CLOCK)(clock=_ros_time(self.clock_ns(now))))
                for raw in self.first_joint_states:
                    stamp = stamp_ns(TYPESTORE.deserialize_cdr(raw, JOINT_STATE).header.stamp)
                    shift = None if self.plan.clock_hz else time.time_ns() - stamp
                    self.publishers[self.joint_route.bag_topic].publish(convert(self.joint_route, raw, shift))
                next_tick = now + (1.0 / self.plan.clock_hz if self.preroll_clock_pub else self.PREROLL_PERIOD_S)
            wake = min(next_tick, self.start_perf) if self.start_perf is not None else next_tick
            time.sleep(max(0.0, min(wake - time.perf_counter(), 0.01)))
        return start_wall_ns

    def play(self, start_wall_ns: int) -> dict:
        plan, routes, bag_start = self.plan, self.routes, self.bag_start
        clock_period = 1.0 / plan.clock_hz if self.clock_pub else None
        next_clock = self.start_perf
        published = {r.node_topic: 0 for r in plan.routes}
        late_ms = []
        last_input_wall_ns = None
        joint_times, joint_positions = [], []
        latest = np.full(len(plan.joint_names), np.nan)   # each joint's latest position, however split

        def tick_clock_until(due: float) -> None:
            """Sleep until `due` (perf_counter s), publishing /clock on its period meanwhile."""
            nonlocal next_clock
            while True:
                now = time.perf_counter()
                if self.clock_pub is not None and next_clock <= min(now, due):
                    self.clock_pub.publish(ros_type(CLOCK)(clock=_ros_time(self.clock_ns(next_clock))))
                    next_clock += clock_period
                    continue
                if now >= due:
                    return
                time.sleep(min(due, next_clock if self.clock_pub is not None else due) - now)

        if self.instruction_pub is not None:
            self.instruction_pub.publish(ros_type(STRING)(data=plan.instruction))
        shift = None
        with Bag(plan.bag) as bag:
            for topic, _, time_ns, raw in bag.messages(list(routes)):
                route = routes[topic]
                due = self.start_perf + (time_ns - bag_start) / 1e9 / plan.rate
                if plan.restamp:
                    # Stamps keep their offset from the message's log time, on the playback's clock.
                    shift = start_wall_ns + int((time_ns - bag_start) / plan.rate) - time_ns
                data = convert(route, raw, shift)
                tick_clock_until(due)
                self.publishers[topic].publish(data)
                late_ms.append((time.perf_counter() - due) * 1e3)
                published[route.node_topic] += 1
                if route.node_type not in (STRING, CLOCK):
                    last_input_wall_ns = time.time_ns()
                if route.node_type == JOINT_STATE:
                    # On the recording's time base: the bag's with /clock, the playback's without.
                    msg = TYPESTORE.deserialize_cdr(raw, JOINT_STATE)
                    try:
                        index, values = reorder_joints(msg.name, msg.position, plan.joint_names)
                    except InputError:
                        continue
                    latest[index] = values
                    if np.isfinite(latest).all():
                        joint_times.append((time_ns - bag_start) / 1e9 / (1.0 if plan.clock_hz else plan.rate))
                        joint_positions.append(latest.tolist())
            damage = bag.damage.to_dict(bag_start) if bag.damage else None
        tick_clock_until(time.perf_counter() + plan.tail_s)
        lateness = np.asarray(late_ms) if late_ms else np.zeros(1)
        return {"published": published, "damage": damage, "last_input_wall_ns": last_input_wall_ns,
                "joint_states": {"times_s": joint_times, "positions": joint_positions},
                **summary(lateness, "p50", "p99", "max", prefix="late_ms_")}


def _ros_time(ns: int):
    from builtin_interfaces.msg import Time
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


# -- the recorder (this process) -----------------------------------------------------------------
class Recorder:
    """Subscribes to every topic the node publishes and writes what arrives into a bag, in the
    node's time base. Messages that arrive before the time base is known wait in memory."""

    def __init__(self, node, writer: BagWriter, topics: dict[str, str], node_name: str, node_fqn: str):
        self.writer = writer
        self.command_topic = f"{node_fqn}/command"
        self.commands = 0
        self.skipped: dict[str, str] = {}
        self.subscriptions = []
        self._pending: list[tuple[str, str, int, bytes]] = []
        self._to_node_time: Optional[Callable[[int], int]] = None
        # /rosout and /parameter_events carry every node's messages: keep the node's own.
        self._keep = {LOG: lambda m: m.name == node_name, PARAMETER_EVENT: lambda m: m.node == node_fqn}
        for topic, msgtype in sorted(topics.items()):
            if msgtype not in TYPESTORE.fielddefs:
                self.skipped[topic] = f"{msgtype} is unknown to rosbags' typestore"
                continue
            self.subscriptions.append(node.create_subscription(
                ros_type(msgtype), topic, lambda raw, t=topic, m=msgtype: self._on_message(t, m, raw),
                _recording_qos(node, topic), raw=True))

    def start(self, to_node_time: Callable[[int], int]) -> None:
        self._to_node_time = to_node_time
        for topic, msgtype, wall_ns, data in self._pending:
            self.writer.write_cdr(topic, msgtype, to_node_time(wall_ns), data)
        self._pending.clear()

    def _on_message(self, topic: str, msgtype: str, raw: bytes) -> None:
        wall_ns = time.time_ns()
        self.commands += topic == self.command_topic
        data = canonical_cdr(raw, msgtype)
        keep = self._keep.get(msgtype)
        if keep is not None and not keep(TYPESTORE.deserialize_cdr(data, msgtype)):
            return
        if self._to_node_time is None:
            self._pending.append((topic, msgtype, wall_ns, data))
        else:
            self.writer.write_cdr(topic, msgtype, self._to_node_time(wall_ns), data)

    def matched(self) -> bool:
        return all(s.get_publisher_count() > 0 for s in self.subscriptions)


def _recording_qos(node, topic: str):
    """Reliable unless a publisher is best effort; transient local only if every publisher is."""
    from rclpy.qos import DurabilityPolicy, QoSProfile, ReliabilityPolicy
    infos = node.get_publishers_info_by_topic(topic)
    reliable = all(i.qos_profile.reliability == ReliabilityPolicy.RELIABLE for i in infos)
    latched = bool(infos) and all(i.qos_profile.durability == DurabilityPolicy.TRANSIENT_LOCAL for i in infos)
    return QoSProfile(depth=100, reliability=ReliabilityPolicy.RELIABLE if reliable else ReliabilityPolicy.BEST_EFFORT,
                      durability=DurabilityPolicy.TRANSIENT_LOCAL if latched else DurabilityPolicy.VOLATILE)


# -- talking to the node -------------------------------------------------------------------------
def _split_name(fqn: str) -> tuple[str, str]:
    namespace, _, name = ("/" + fqn.strip("/")).rpartition("/")
    return name, namespace or "/"


class Waiter:
    """Spins the recorder's executor until a condition holds, the deadline passes, or abort_if
    gives a reason to stop."""

    def __init__(self, executor, deadline: float, abort_if: Optional[Callable[[], Optional[str]]]):
        self.executor, self.deadline, self.abort_if = executor, deadline, abort_if

    def until(self, condition: Callable[[], bool], deadline: Optional[float] = None) -> bool:
        while not condition():
            reason = self.abort_if() if self.abort_if else None
            if reason:
                raise LiveError(reason)
            if time.monotonic() >= (deadline or self.deadline):
                return False
            self.executor.spin_once(timeout_sec=0.05)
        return True


def _wait_for_active(node, wait: Waiter, fqn: str, progress: Progress) -> None:
    from lifecycle_msgs.srv import GetState
    client = node.create_client(GetState, f"{fqn}/get_state")
    progress(f"waiting for {fqn} to be active")
    if not wait.until(client.service_is_ready):
        raise LiveError(f"node {fqn} not found: no {fqn}/get_state service (is vla-node running?)")
    label = "unknown"
    while time.monotonic() < wait.deadline:
        answer = read_service(lambda: client.call_async(GetState.Request()), wait.until, wait.deadline)
        if answer is not None:
            label = answer.current_state.label
            if label == "active":
                node.destroy_client(client)
                return
        wait.until(lambda: False, time.monotonic() + 0.2)   # not active yet: ask again shortly
    raise LiveError(f"node {fqn} is {label}, not active (start it with -p autostart:=true or activate it)")


def read_service(send: Callable[[], object], until: Callable[[Callable[[], bool], float], bool], deadline: float):
    """The first answer to the read-only request that send() sends (and returns the future of),
    sent again every RESEND_S until one comes; None at `deadline`. until(condition, deadline) waits
    for the condition (spinning the client's executor, or while another thread spins it)."""
    futures = []
    while time.monotonic() < deadline:
        futures.append(send())
        until(lambda: any(f.done() for f in futures), min(deadline, time.monotonic() + RESEND_S))
        answers = [f.result() for f in futures if f.done() and f.result() is not None]
        if answers:
            return answers[0]
    return None


def _node_parameters(node, wait: Waiter, fqn: str) -> dict:
    from rclpy.parameter import parameter_value_to_python
    from rclpy.parameter_client import AsyncParameterClient
    client = AsyncParameterClient(node, fqn)
    if not wait.until(client.services_are_ready):
        raise LiveError(f"node {fqn} does not answer parameter requests")
    answer = read_service(lambda: client.get_parameters(list(NODE_PARAMETERS)), wait.until, wait.deadline)
    if answer is None:
        raise LiveError(f"node {fqn} did not return its parameters {list(NODE_PARAMETERS)}")
    values = [parameter_value_to_python(v) for v in answer.values]
    missing = [n for n, v in zip(NODE_PARAMETERS, values) if v is None]
    if missing:
        raise LiveError(f"node {fqn} has no parameters {missing}: is it a vla_node?")
    return {n: (list(v) if isinstance(v, (list, tuple)) or hasattr(v, "tolist") else v)
            for n, v in zip(NODE_PARAMETERS, values)}


def _node_topics(node, wait: Waiter, fqn: str) -> dict[str, str]:
    """Topics the node publishes, once its command and trajectory publishers are visible."""
    from rclpy.node import NodeNameNonExistentError

    name, namespace = _split_name(fqn)
    needed = {f"{fqn}/command", f"{fqn}/joint_trajectory"}
    topics: dict[str, str] = {}

    def found() -> bool:
        topics.clear()
        try:
            published = node.get_publisher_names_and_types_by_node(name, namespace)
        except NodeNameNonExistentError:
            return False   # its services answered, but the graph here has not caught up yet
        topics.update({t: types[0] for t, types in published})
        return needed <= set(topics)

    if not wait.until(found):
        raise LiveError(f"node {fqn} does not publish {sorted(needed - set(topics))}")
    return topics


# -- the whole run --------------------------------------------------------------------------------
@dataclass
class LiveRun:
    options: LiveOptions
    params: dict
    clock: bool
    recording: Path
    start_wall_ns: int          # when playback started
    bag_start_ns: int           # the bag's first log time, played at start_wall_ns
    playback: dict = field(default_factory=dict)   # the player's report
    skipped_topics: dict = field(default_factory=dict)

    def node_time(self, wall_ns: int) -> int:
        """Wall-clock time -> the node's time (the bag's time when /clock drives it)."""
        if not self.clock:
            return wall_ns
        return self.bag_start_ns + int((wall_ns - self.start_wall_ns) * self.options.rate)


def replay_live(options: LiveOptions, progress: Progress = print) -> dict:
    """Play the bag into the running node, record what it publishes; returns the summary."""
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    if options.rate <= 0:
        raise ValueError(f"rate must be > 0, got {options.rate}")
    if options.clock not in ("auto", "on", "off"):
        raise ValueError(f"clock must be auto, on or off, got {options.clock!r}")
    fqn = "/" + options.node.strip("/")
    with Bag(options.bag) as bag:   # a missing or unreadable bag fails before any waiting
        if bag.message_count == 0:
            raise BagError(f"{options.bag} has no messages")
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("vla_replay_recorder", context=context, start_parameter_services=False)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    player = None
    try:
        wait = Waiter(executor, time.monotonic() + options.wait_s, options.abort_if)
        _wait_for_active(node, wait, fqn, progress)
        params = _node_parameters(node, wait, fqn)
        clock = params["use_sim_time"] if options.clock == "auto" else options.clock == "on"
        if params["use_sim_time"] and not clock:
            raise LiveError(f"{fqn} uses sim time: it needs /clock (leave --clock auto or on)")
        with Bag(options.bag) as bag:
            plan = plan_playback(bag, params, options, clock, fqn)
            bag_start_ns, duration_s = bag.start_ns, bag.duration_s
        large_frames = "FASTDDS_DEFAULT_PROFILES_FILE" in os.environ or \
            os.environ.get("FASTDDS_BUILTIN_TRANSPORTS") == "LARGE_DATA"
        if any(r.node_type == IMAGE for r in plan.routes) and not large_frames:
            progress(f"note: Fast DDS's default transports lose most raw camera images; run the replay with "
                     f"FASTDDS_DEFAULT_PROFILES_FILE={FRAME_TRANSPORT_PROFILE}")
        topics = _node_topics(node, wait, fqn)
        recording = options.out / f"recording_{datetime.now():%Y%m%d_%H%M%S}"
        with BagWriter(recording, options.storage) as writer:
            recorder = Recorder(node, writer, topics, _split_name(fqn)[0], fqn)
            if not wait.until(recorder.matched):
                raise LiveError(f"could not subscribe to every topic {fqn} publishes: {sorted(topics)}")
            ctx = mp.get_context("spawn")   # never fork a process that runs DDS threads
            conn, child = ctx.Pipe()
            player = ctx.Process(target=play, args=(plan, child), name="vla_replay_player", daemon=True)
            player.start()
            _, unmatched = _receive(conn, wait, player, wait.deadline + 30.0)
            if unmatched:
                raise LiveError(f"the player's publishers on {unmatched} found no subscriber within "
                                f"{options.wait_s:g} s (does {fqn} subscribe to them? is DDS discovery blocked?)")
            conn.send(("preroll", None))
            if not wait.until(lambda: recorder.commands > 0, time.monotonic() + options.wait_s):
                raise LiveError(f"{fqn} published no command within {options.wait_s:g} s of being sent joint states "
                                f"on {params['joint_states_topic']}")
            start_wall_ns = time.time_ns() + int(START_LEAD_S * 1e9)
            conn.send(("go", start_wall_ns))
            progress(f"playing {options.bag} into {fqn} at {options.rate:g}x"
                     f"{' with /clock' if clock else ''}; recording {recording}")
            run = LiveRun(options, params, clock, recording, start_wall_ns, bag_start_ns)
            recorder.start(run.node_time)
            play_deadline = time.monotonic() + START_LEAD_S + duration_s / options.rate + options.tail_s + 60.0
            _, run.playback = _receive(conn, wait, player, play_deadline)
            run.skipped_topics = recorder.skipped
            for subscription in recorder.subscriptions:
                node.destroy_subscription(subscription)
        summary, series = summarize(run)
        summary["plots"] = [str(p) for p in write_plots(summary, series, options.out, params["joint_names"])]
        summary["summary_json"] = str(options.out / "summary.json")
        write_summary(summary, options.out / "summary.json")
        return summary
    finally:
        if player is not None:
            player.join(timeout=5.0)
            if player.is_alive():
                player.terminate()
        executor.shutdown()
        node.destroy_node()
        rclpy.try_shutdown(context=context)


def _receive(conn, wait: Waiter, player, deadline: float):
    """The player's next report, spinning the recorder meanwhile."""
    def reported() -> bool:
        if not player.is_alive() and not conn.poll():
            raise LiveError(f"the player process ended unexpectedly (exit code {player.exitcode})")
        return conn.poll()

    if not wait.until(reported, deadline):
        raise LiveError("the player process did not report in time")
    kind, payload = conn.recv()
    if kind == "error":
        raise LiveError(f"playback failed: {payload}")
    return kind, payload


# -- the summary ---------------------------------------------------------------------------------
@dataclass
class Series:
    """What the plots draw, in seconds since playback start on the node's clock."""
    command_times_s: np.ndarray
    commands: np.ndarray               # [n, joints]
    trajectory_times_s: np.ndarray     # chunk arrivals
    input_times_s: np.ndarray          # the joint states played into the node
    inputs: np.ndarray


def summarize(run: LiveRun) -> tuple[dict, Series]:
    fqn = "/" + run.options.node.strip("/")
    params = run.params
    rate_hz = params["control_rate_hz"]
    commands, trajectories, statuses = [], [], []
    with Bag(run.recording) as bag:
        topics = [t for t in (f"{fqn}/command", f"{fqn}/joint_trajectory", "/diagnostics") if t in bag.topics]
        for topic, msgtype, time_ns, raw in bag.messages(topics):
            msg = bag.deserialize(raw, msgtype, topic)
            if msgtype == FLOAT64_MULTI_ARRAY:
                commands.append((time_ns, np.asarray(msg.data, np.float64)))
            elif msgtype == JOINT_TRAJECTORY:
                trajectories.append(time_ns)
            elif msgtype == DIAGNOSTIC_ARRAY:
                statuses += [(time_ns, s) for s in msg.status if s.hardware_id == fqn]
    t0 = run.node_time(run.start_wall_ns)
    times = np.array([t for t, _ in commands], np.int64)
    periods_ms = np.diff(times) / 1e6
    jitter = np.abs(periods_ms - 1e3 / rate_hz)
    measured_hz = (len(times) - 1) / ((times[-1] - times[0]) / 1e9) if len(times) > 2 else 0.0

    # One chunk per replan_threshold control ticks while inputs are fresh (if inference is faster
    # than that): from the first chunk until input_timeout_s after the last input.
    chunk_period_s = params["replan_threshold"] / rate_hz
    expected = None
    if trajectories and run.playback["last_input_wall_ns"]:
        live_end = run.node_time(run.playback["last_input_wall_ns"]) + int(params["input_timeout_s"] * 1e9)
        expected = int(max(0, live_end - trajectories[0]) / 1e9 // chunk_period_s) + 1

    node_values = {kv.key: kv.value for kv in statuses[-1][1].values} if statuses else {}
    holds = []
    for time_ns, status in statuses:
        reason = status.message if status.level != 0 else None
        if reason and (not holds or holds[-1][1] != reason):
            holds.append(((time_ns - t0) / 1e9, reason))
    stages = {}
    for stage in STAGES:
        p50 = node_values.get(Key.ms(Key.engine_stage(stage), "p50"))
        p99 = node_values.get(Key.ms(Key.engine_stage(stage), "p99"))
        if p50 is not None and p99 is not None:
            stages[stage] = {"p50": float(p50), "p99": float(p99)}
    summary = {
        "bag": str(run.options.bag), "node": fqn, "rate": run.options.rate, "clock": run.clock,
        "recording": str(run.recording), "published": run.playback["published"],
        "playback_late_ms": {k: run.playback[f"late_ms_{k}"] for k in ("p50", "p99", "max")},
        "bag_damage": run.playback["damage"], "skipped_topics": run.skipped_topics,
        "chunks": len(trajectories), "expected_chunks": expected, "chunk_period_s": chunk_period_s,
        "first_chunk_s": (trajectories[0] - t0) / 1e9 if trajectories else None,
        "node_chunks": _number(node_values.get(Key.CHUNKS)),
        "node_late_chunks": _number(node_values.get(Key.LATE_CHUNKS)),
        "commands": len(commands), "control_rate_hz": rate_hz, "command_rate_hz": measured_hz,
        "command_period_ms": _stats(periods_ms), "command_jitter_ms": _stats(jitter),
        "node_command_jitter_ms": {k: _number(node_values.get(Key.ms(Key.COMMAND_JITTER, k)))
                                   for k in ("p50", "p99", "max")},
        "latency_ms": stages,
        "round_trip_ms": {k: _number(node_values.get(Key.ms(Key.ROUND_TRIP, k))) for k in ("p50", "p99", "max")},
        "holds": {"by_cause": _counts(node_values.get(Key.HOLDS_BY_CAUSE)),
                  "plan_underruns": _number(node_values.get(Key.PLAN_UNDERRUNS)),
                  "changes": [{"t_s": t, "status": r} for t, r in holds]},
    }
    inputs = run.playback["joint_states"]
    series = Series(command_times_s=(times - t0) / 1e9,
                    commands=np.stack([c for _, c in commands]) if commands else np.zeros((0, 0)),
                    trajectory_times_s=(np.array(trajectories, np.int64) - t0) / 1e9,
                    input_times_s=np.asarray(inputs["times_s"]),
                    inputs=np.asarray(inputs["positions"], np.float64).reshape(-1, len(params["joint_names"])))
    return summary, series


def _number(text: Optional[str]):
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return int(value) if value.is_integer() else value


def _counts(text: Optional[str]) -> dict:
    """'a=2, b=1' (the node's counters) -> {'a': 2, 'b': 1}."""
    pairs = [item.rpartition("=") for item in (text or "").split(", ")]
    return {k: int(v) for k, sep, v in pairs if sep and v.isdigit()}


def _stats(values: np.ndarray) -> dict:
    return summary(values, "p50", "p99", "max", "std")


def write_plots(summary: dict, series: Series, out_dir: Path, joint_names: Sequence[str]) -> list[Path]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    times, values = series.command_times_s, series.commands
    if len(values):
        dims = values.shape[1]
        fig, axes = plt.subplots((dims + 1) // 2, 2, figsize=(11, 1.9 * ((dims + 1) // 2) + 0.6), sharex=True)
        for d, ax in enumerate(axes.flat[:dims]):
            for t in series.trajectory_times_s:
                ax.axvline(t, color="0.88", lw=0.5, zorder=0)
            if series.inputs.shape[1] == dims:
                ax.plot(series.input_times_s, series.inputs[:, d], color="0.5", lw=1, ls="--", label="joint state in")
            ax.plot(times, values[:, d], lw=1, label="command out")
            ax.set_ylabel(joint_names[d] if d < len(joint_names) else f"joint {d}", fontsize=8)
        for ax in axes.flat[dims:]:
            ax.set_visible(False)
        for ax in axes[-1]:
            ax.set_xlabel("time since playback start (s); grey: chunk arrivals")
        axes.flat[0].legend(fontsize=7)
        fig.suptitle(f"{summary['node']}/command during the replay of {Path(summary['bag']).name}")
        fig.tight_layout()
        paths.append(out_dir / "commands.png")
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)

    fig, (hist, bars) = plt.subplots(1, 2, figsize=(12, 4))
    periods = np.diff(times) * 1e3
    if len(periods):
        hist.hist(periods, bins=40)
        hist.axvline(1e3 / summary["control_rate_hz"], color="k", ls="--", lw=1, label="configured period")
        hist.legend(fontsize=8)
    hist.set_xlabel("command period as received (ms)")
    hist.set_ylabel("commands")
    stages = summary["latency_ms"]
    if stages:
        names = list(stages)
        x = np.arange(len(names))
        bars.bar(x - 0.2, [stages[s]["p50"] for s in names], 0.4, label="p50")
        bars.bar(x + 0.2, [stages[s]["p99"] for s in names], 0.4, label="p99")
        bars.set_xticks(x, names)
        bars.legend(fontsize=8)
    bars.set_ylabel("engine latency per stage, as the node reports (ms)")
    fig.tight_layout()
    paths.append(out_dir / "timing.png")
    fig.savefig(paths[-1], dpi=100)
    plt.close(fig)
    return paths


def write_summary(summary: dict, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")


def print_summary(summary: dict, print_fn: Progress = print) -> None:
    def fmt(d: dict, unit="ms") -> str:
        return " / ".join(f"{d[k]:.1f}" if d.get(k) is not None else "-" for k in ("p50", "p99", "max")) + f" {unit}"

    print_fn(f"replayed {summary['bag']} into {summary['node']} at {summary['rate']:g}x"
             f"{' (sim time from /clock)' if summary['clock'] else ''}: "
             + ", ".join(f"{n} on {t}" for t, n in summary["published"].items()))
    if summary["bag_damage"]:
        print_fn(f"  PARTIAL BAG: {summary['bag_damage']['summary']}")
    expected = summary["expected_chunks"]
    late = summary["node_late_chunks"]
    print_fn(f"  chunks received:   {summary['chunks']} (the node counted {summary['node_chunks']}"
             + (f", and dropped {late:g} that came too late to execute" if late else "") + ")"
             + (f"; expected ~{expected}: one per {summary['chunk_period_s'] * 1e3:.0f} ms while inputs are fresh"
                if expected is not None else ""))
    if summary["first_chunk_s"] is not None:
        print_fn(f"  first chunk:       {summary['first_chunk_s']:.2f} s after playback start "
                 f"(the first frames, then one inference)")
    print_fn(f"  command rate:      {summary['command_rate_hz']:.2f} Hz over {summary['commands']} commands "
             f"(configured {summary['control_rate_hz']:g} Hz)")
    print_fn(f"  command jitter:    {fmt(summary['command_jitter_ms'])} (p50 / p99 / max |period - "
             f"{1e3 / summary['control_rate_hz']:.0f} ms|, as received)")
    node_jitter = summary["node_command_jitter_ms"]
    if node_jitter.get("p99") is not None:
        print_fn(f"                     {fmt(node_jitter)} (as the node's timer measured it)")
    if summary["latency_ms"]:
        print_fn("  latency per stage: " + ", ".join(f"{s} {v['p50']:.1f}/{v['p99']:.1f}"
                                                  for s, v in summary["latency_ms"].items()) + " ms (p50/p99)")
    if summary["round_trip_ms"].get("p50") is not None:
        print_fn(f"  request -> chunk: {fmt(summary['round_trip_ms'])} (node to engine process and back)")
    holds = summary["holds"]
    causes = ", ".join(f"{cause} x{n}" for cause, n in holds["by_cause"].items()) or "none"
    print_fn(f"  holds:             {causes}; plan ran out {holds['plan_underruns']} times")
    for change in (c for c in holds["changes"] if c["t_s"] >= 0):   # during playback
        status = change["status"] if len(change["status"]) <= 100 else change["status"][:97] + "..."
        print_fn(f"    t={change['t_s']:6.2f} s  {status}")
    for topic, why in summary["skipped_topics"].items():
        print_fn(f"  not recorded: {topic} ({why})")
    print_fn(f"  recording: {summary['recording']}")
    print_fn(f"  summary:   {summary['summary_json']}")
    print_fn("  plots:     " + ", ".join(summary["plots"]))
