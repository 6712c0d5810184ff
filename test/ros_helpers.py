"""Shared helpers for the node tests: the node as a real subprocess, and a test-side rclpy node
that feeds it synthetic camera + joint streams and watches everything it publishes.

Every wait is on a condition (a message, a matched count, a log line) with a timeout, never a
fixed sleep. Each test module gets its own ROS domain (conftest.py), and each node its own
namespace, where its inputs are too (the node's input topics are relative): a node hears only
the harness made for it.
"""
from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from vla_node.ros.messages import stamp_ns
from vla_node.tools.live import RESEND_S, read_service
from vla_node.tools.node_process import interrupt, node_argv, ros_domain, ros_environment

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "config" / "tiny.yaml"
JOINTS = [f"panda_joint{i}" for i in range(1, 8)] + ["panda_gripper"]
HOME = np.array([0.0, -0.5, 0.0, -2.0, 0.0, 1.5, 0.8, 0.5])
CAMERA_TOPICS = ["cameras/exo/image_raw", "cameras/wrist/image_raw"]   # relative: in the node's namespace
FRAME_LOOP = 8
RECORDED_DEPTH = 1000   # the queue of each output the harness records (Harness._make_io)
# config/tiny.yaml's command limits (the Panda's): what every command of the node must respect.
LOWER = np.array([-2.8973, -1.7628, -2.8973, -3.0718, -2.8973, -0.0175, -2.8973, 0.0])
UPPER = np.array([2.8973, 1.7628, 2.8973, -0.0698, 2.8973, 3.7525, 2.8973, 1.0])
MAX_STEP = np.array([0.05] * 7 + [0.2])


def assert_commands_safe(commands: np.ndarray) -> None:
    """Every command [ticks, joints] finite, within LOWER..UPPER, and at most MAX_STEP from the one before."""
    assert np.isfinite(commands).all()
    assert (commands >= LOWER - 1e-9).all() and (commands <= UPPER + 1e-9).all()
    assert (np.abs(np.diff(commands, axis=0)) <= MAX_STEP + 1e-9).all()
_counter = iter(range(1, 10**6))


def ros_env() -> dict:
    """Environment for this process and the node: the test module's ROS domain (conftest.py
    chooses one per module), Fast DDS with shared memory big enough for raw 640x480 frames (the
    default transports lose most of them), logs under out/ros_log unless ROS_LOG_DIR says."""
    if "VLA_TEST_DOMAIN" not in os.environ:
        os.environ["VLA_TEST_DOMAIN"] = ros_domain()
    ros_environment(os.environ["VLA_TEST_DOMAIN"], ROOT / "out" / "ros_log")
    os.environ["RCUTILS_COLORIZED_OUTPUT"] = "0"
    os.environ["PYTHONUNBUFFERED"] = "1"
    return dict(os.environ)


class EngineServer:
    """`vla-engine-server --socket PATH [--batch-window-ms MS]` with its output collected."""

    def __init__(self, path: str, batch_window_ms: Optional[float] = None):
        self.path = path
        self.log = open(f"{path}.log", "w+")
        window = [] if batch_window_ms is None else ["--batch-window-ms", str(batch_window_ms)]
        self.proc = subprocess.Popen([sys.executable, "-m", "vla_node.ros.engine_server", "--socket", path, *window],
                                     stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT)
        deadline = time.monotonic() + 60
        while not os.path.exists(path):
            assert self.proc.poll() is None and time.monotonic() < deadline, self.output()
            time.sleep(0.05)

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def wait_for(self, text: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.output():
            assert time.monotonic() < deadline, f"no {text!r} in the server's output:\n{self.output()}"
            time.sleep(0.05)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        return self.proc.wait(20)


class NodeProcess:
    """`vla-node --ros-args --params-file config/tiny.yaml -p name:=value ...` with its output
    collected line by line. Each node gets its own namespace (unless one is given), so a test
    never talks to another test's node."""

    def __init__(self, overrides: Optional[dict] = None, params_file: Path = TINY_YAML, ros_args: tuple = (),
                 namespace: Optional[str] = None, env: Optional[dict] = None):
        self.namespace = namespace or f"/t{os.getpid()}_{next(_counter)}"
        self.name = f"{self.namespace}/vla_node"
        self.command = node_argv(params_file, overrides, ["-r", f"__ns:={self.namespace}", *ros_args])
        self.lines: list[str] = []
        self._changed = threading.Condition()
        self.proc = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     env={**ros_env(), **(env or {})}, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def count(self, text: str) -> int:
        with self._changed:
            return sum(text in line for line in self.lines)

    def wait_for_line(self, text: str, timeout: float = 60.0, occurrence: int = 1) -> str:
        """The `occurrence`-th line containing `text`, once the node has printed it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                found = [line for line in self.lines if text in line]
                if len(found) >= occurrence:
                    return found[occurrence - 1]
                left = deadline - time.monotonic()
                if left <= 0 or self.proc.poll() is not None:
                    raise AssertionError(f"no log line with {text!r} (exit code {self.proc.poll()}); output:\n"
                                         + "\n".join(self.lines[-40:]))
                self._changed.wait(min(left, 0.5))

    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def stop(self, timeout: float = 20.0) -> int:
        """Ctrl-C, as a user would; the node must end its engine process and exit."""
        code = interrupt(self.proc, timeout)
        self._reader.join(5)
        return code

    def stop_cleanly(self) -> None:
        """stop(), which must end with exit code 0 (else the error shows the node's last output)."""
        code = self.stop()
        assert code == 0, f"exit code {code}; node output:\n" + "\n".join(self.lines[-40:])


def command_stamps_ns(h: "Harness", since: float = 0.0) -> np.ndarray:
    """The node's stamps (its clock when each control tick published) of the ~/joint_command
    messages received since `since` (publish_joint_command): rates checked on these do not depend
    on when DDS delivered them here."""
    return np.array([stamp_ns(m.header.stamp) for m in h.messages("joint_command", since)], np.int64)


def assert_ticks_at(period_s: float, stamps_ns: np.ndarray) -> None:
    """Control ticks stamped `stamps_ns` (in order) run at `period_s` or slower, never faster: the
    median interval at least 0.9 periods, and no span holds more than one tick per period (+2 for
    the ends, the first one stamped late). How close to the period a busy machine keeps them is
    the benchmarks' to say, not a test's: beside three busy loops and the suite, a 50 Hz tick that
    took over a period ran every other period, 40 ms apart for seconds (the timer skips the
    periods it missed). Tests show a new rate took effect by the period the node plans with."""
    assert len(stamps_ns) >= 10, f"only {len(stamps_ns)} ticks"
    intervals_s = np.diff(stamps_ns) / 1e9
    assert np.median(intervals_s) >= 0.9 * period_s, \
        f"median tick interval {np.median(intervals_s) * 1e3:.1f} ms, under {period_s * 1e3:.1f} ms"
    span_s = (stamps_ns[-1] - stamps_ns[0]) / 1e9
    assert len(stamps_ns) <= span_s / period_s + 2, f"{len(stamps_ns)} ticks in {span_s:.3f} s"


def chunk_period_ticks(live: dict, replan_threshold: int = 8, period_s: float = 0.02) -> int:
    """Control ticks per chunk that a node fed by `vla-replay live` could keep (`live`: the
    replay's summary; config/tiny.yaml's replan_threshold and rate): one chunk per replan_threshold
    ticks while inference is faster than that, one per inference where it is slower, as on a busy
    machine (the plan then waits for each chunk). Its slowest request -> chunk time bounds it."""
    return max(replan_threshold, math.ceil(live["round_trip_ms"]["max"] / 1e3 / period_s) + 1)


def chunks_answered(live: dict) -> int:
    """The chunks the node of a `vla-replay live` run published, and those it dropped because they
    came after their last action (inference slower than the horizon)."""
    return live["chunks"] + (live["node_late_chunks"] or 0)


def jump_back_fits(status: str, back_s: float, clock_period_s: float) -> bool:
    """Whether `status` says the clock jumped back by `back_s` less one clock period, or less a few
    periods more: rclpy measures the jump from the last /clock message the node had taken, which
    on a busy machine may be one or more before the jump (seen under pytest -n 2 and beside busy
    loops)."""
    found = re.search(r"clock jumped back by ([0-9.]+) s", status)
    return found is not None and back_s - 0.1 < float(found[1]) <= back_s - clock_period_s + 5e-4


def rgb_frame(height: int, width: int, seed: int) -> np.ndarray:
    """A smooth synthetic camera image (gradients that move with the seed)."""
    y = np.linspace(0, 255, height, dtype=np.float32)[:, None]
    x = np.linspace(0, 255, width, dtype=np.float32)[None, :]
    r = (x + seed * 7) % 256
    g = (y + seed * 3) % 256
    b = (x * 0.5 + y * 0.5 + seed * 11) % 256
    return np.stack([np.broadcast_to(c, (height, width)) for c in (r, g, b)], axis=-1).astype(np.uint8)


def poll_until(condition: Callable[[], bool], deadline: float) -> bool:
    """Whether `condition` came true by `deadline` (another thread spins what makes it so)."""
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


class Harness:
    """A test-side node on its own executor thread: publishes synthetic inputs, records outputs."""

    def __init__(self, node: NodeProcess):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        ros_env()
        # The node's services exist once it says so; then DDS discovery may take a few seconds more.
        node.wait_for_line("started: ", timeout=120)
        self.process = node
        self.target = node.name
        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node(f"harness_{next(_counter)}", context=self.context)
        self.sim_time_ns: Optional[int] = None       # set: stamps and /clock use this simulated time
        self.changed = threading.Condition()
        self.received: dict[str, list] = {"command": [], "trajectory": [], "diagnostics": [], "joint_command": []}
        self._streams = []
        self._make_io()
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._spinner = threading.Thread(target=self._spin, daemon=True)
        self._spinner.start()

    def _spin(self) -> None:
        from rclpy.executors import ExternalShutdownException
        try:
            self.executor.spin()
        except ExternalShutdownException:
            pass

    def _make_io(self) -> None:
        from diagnostic_msgs.msg import DiagnosticArray
        from lifecycle_msgs.srv import ChangeState, GetState
        from rcl_interfaces.srv import DescribeParameters, GetParameters, SetParameters
        from rclpy.qos import qos_profile_sensor_data
        from rosgraph_msgs.msg import Clock
        from sensor_msgs.msg import CompressedImage, Image, JointState
        from std_msgs.msg import Bool, Float64MultiArray, String
        from trajectory_msgs.msg import JointTrajectory

        n, ns = self.node, self.process.namespace
        self.camera_pubs = {}     # by the node's (relative) topic name
        for topic in CAMERA_TOPICS:
            self.camera_pubs[topic] = n.create_publisher(Image, f"{ns}/{topic}", qos_profile_sensor_data)
            self.camera_pubs[topic + "/compressed"] = n.create_publisher(CompressedImage, f"{ns}/{topic}/compressed",
                                                                         qos_profile_sensor_data)
        self.joint_pub = n.create_publisher(JointState, f"{ns}/joint_states", qos_profile_sensor_data)
        self.instruction_pub = n.create_publisher(String, f"{ns}/instruction", 10)
        self.estop_pub = n.create_publisher(Bool, f"{ns}/estop", 10)
        self.clock_pub = n.create_publisher(Clock, "/clock", 10)
        # 20 s of 50 Hz commands queued: the tests check every consecutive pair of commands, and
        # this process's executor, busy with the robot's streams and the tests' scans of what it
        # recorded, fell more than the 50 messages of before behind on a busy 2-core machine (a
        # command dropped from the queue made two ticks look like one step too large).
        depth = RECORDED_DEPTH
        self.subs = [
            n.create_subscription(Float64MultiArray, f"{self.target}/command", self._recorder("command"), depth),
            n.create_subscription(JointTrajectory, f"{self.target}/joint_trajectory", self._recorder("trajectory"),
                                  depth),
            n.create_subscription(JointState, f"{self.target}/joint_command", self._recorder("joint_command"), depth),
            n.create_subscription(DiagnosticArray, "/diagnostics", self._recorder("diagnostics"), depth),
        ]
        self.change_state = n.create_client(ChangeState, f"{self.target}/change_state")
        self.get_state = n.create_client(GetState, f"{self.target}/get_state")
        self.set_params = n.create_client(SetParameters, f"{self.target}/set_parameters")
        self.get_params = n.create_client(GetParameters, f"{self.target}/get_parameters")
        self.describe_params = n.create_client(DescribeParameters, f"{self.target}/describe_parameters")

    def _recorder(self, key: str):
        def record(msg):
            with self.changed:
                self.received[key].append((time.monotonic(), msg))
                self.changed.notify_all()
        return record

    # -- time -------------------------------------------------------------------------------------
    def now_ns(self) -> int:
        if self.sim_time_ns is not None:
            return self.sim_time_ns
        return self.node.get_clock().now().nanoseconds

    def stamp(self):
        from builtin_interfaces.msg import Time
        t = self.now_ns()
        return Time(sec=t // 1_000_000_000, nanosec=t % 1_000_000_000)

    def publish_clock(self, t_ns: int) -> None:
        from rosgraph_msgs.msg import Clock
        self.sim_time_ns = t_ns
        msg = Clock()
        msg.clock = self.stamp()
        self.clock_pub.publish(msg)

    # -- streams ----------------------------------------------------------------------------------
    def every(self, period_s: float, callback: Callable[[], None]):
        """A wall-clock timer on the harness executor (keeps publishing while the test waits)."""
        from rclpy.clock import Clock, ClockType
        timer = self.node.create_timer(period_s, callback, clock=Clock(clock_type=ClockType.STEADY_TIME))
        self._streams.append(timer)
        return timer

    def stop_streams(self) -> None:
        for timer in self._streams:
            self.node.destroy_timer(timer)
        self._streams = []

    # -- waiting ----------------------------------------------------------------------------------
    def wait_until(self, predicate: Callable[[], object], timeout: float, what: str):
        # The predicate runs without the lock: it may call a service, whose answer needs the
        # executor thread, which takes the lock to record messages.
        deadline = time.monotonic() + timeout
        while True:
            value = predicate()
            if value:
                return value
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n"
                                     f"last diagnostics: {self._last_status()}\nnode output:\n"
                                     + "\n".join(self.process.output().splitlines()[-30:]))
            with self.changed:
                self.changed.wait(min(left, 0.1))

    def _last_status(self):
        statuses = self.diagnostics_since(0.0)
        return statuses[-1] if statuses else None

    def wait_matched(self, timeout: float = 60.0) -> None:
        """Until DDS has matched the node's inputs and outputs with this node's."""
        def matched():
            pubs = [self.joint_pub, self.instruction_pub, self.estop_pub]
            return all(p.get_subscription_count() > 0 for p in pubs) and \
                all(s.get_publisher_count() > 0 for s in self.subs[:2])
        self.wait_until(matched, timeout, "the node's topics to match")

    def messages(self, key: str, since: float = 0.0) -> list:
        with self.changed:
            return [m for t, m in self.received[key] if t >= since]

    def times(self, key: str, since: float = 0.0) -> list[float]:
        with self.changed:
            return [t for t, _ in self.received[key] if t >= since]

    def diagnostics_since(self, since: float) -> list[dict]:
        out = []
        for msg in self.messages("diagnostics", since):
            for status in msg.status:
                if status.hardware_id == self.target:
                    values = {kv.key: kv.value for kv in status.values}
                    values["_message"], values["_level"] = status.message, int.from_bytes(status.level, "little") \
                        if isinstance(status.level, bytes) else int(status.level)
                    values["_stamp_ns"] = stamp_ns(msg.header.stamp)
                    out.append(values)
        return out

    def newest_running(self) -> Optional[dict]:
        """The node's newest report if it says the node runs and its process is up, else None
        (a report comes a second after the one before, and at once when a fault starts or ends or
        the control loop starts or stops commanding: a case that starts from a running node need
        not wait for a new one, and one that ends with the node commanding again has its report)."""
        reports = self.diagnostics_since(0.0)
        if reports and reports[-1]["_message"] == "running" and self.process.proc.poll() is None:
            return reports[-1]
        return None

    def wait_diagnostics(self, predicate: Callable[[dict], bool], timeout: float, what: str,
                         since: Optional[float] = None) -> dict:
        since = time.monotonic() if since is None else since
        def find():
            for d in self.diagnostics_since(since):
                if predicate(d):
                    return d
            return None
        return self.wait_until(find, timeout, what)

    def wait_commands(self, count: int, timeout: float = 60.0, since: Optional[float] = None) -> list:
        since = time.monotonic() if since is None else since
        return self.wait_until(lambda: len(self.messages("command", since)) >= count and
                               self.messages("command", since), timeout, f"{count} commands")

    # -- services ---------------------------------------------------------------------------------
    def call(self, client, request, timeout: float = 60.0, read_only: bool = False,
             settled: Optional[Callable[[], object]] = None):
        """The node's answer. A read-only request is sent again while its answer does not come
        (live.read_service: a response to a client the service has not matched yet is lost); for
        another, `settled` is asked every RESEND_S meanwhile, and what it returns, if not None, stands
        for the answer."""
        # Discovery normally takes a few seconds; a loaded 2-core machine can take much longer.
        if not client.wait_for_service(timeout_sec=60.0):
            raise AssertionError(f"service {client.srv_name} not available after 60 s (node exit code "
                                 f"{self.process.proc.poll()}); node output:\n"
                                 + "\n".join(self.process.output().splitlines()[-30:]))
        if read_only:
            answer = read_service(lambda: client.call_async(request), poll_until, time.monotonic() + timeout)
            if answer is None:
                raise AssertionError(f"no answer from {client.srv_name} within {timeout:.0f} s")
            return answer
        future = client.call_async(request)
        deadline = time.monotonic() + timeout
        while not poll_until(future.done, min(deadline, time.monotonic() + RESEND_S)):
            if time.monotonic() >= deadline:
                raise AssertionError(f"no answer from {client.srv_name} within {timeout:.0f} s")
            outcome = settled() if settled is not None else None
            if outcome is not None:
                return outcome
        return future.result()

    def transition(self, label: str, timeout: float = 120.0) -> bool:
        """Whether the transition succeeded. While its response does not come (it may be lost: call),
        the node in the transition's goal state, which it was not in before, says it succeeded: only
        success reaches inactive or active (cleanup's and shutdown's goals are reached by errors too)."""
        from lifecycle_msgs.srv import ChangeState
        request = ChangeState.Request()
        request.transition.label = label
        goal = {"configure": "inactive", "activate": "active", "deactivate": "inactive"}.get(label)

        def reached_goal() -> Optional[ChangeState.Response]:
            return ChangeState.Response(success=True) if self._state_now() == goal else None

        watch = goal is not None and self.state() != goal
        return self.call(self.change_state, request, timeout, settled=reached_goal if watch else None).success

    def _state_now(self) -> Optional[str]:
        """The node's state, or None where it does not answer within a few seconds."""
        from lifecycle_msgs.srv import GetState
        try:
            return self.call(self.get_state, GetState.Request(), RESEND_S, read_only=True).current_state.label
        except AssertionError:
            return None

    def state(self) -> str:
        from lifecycle_msgs.srv import GetState
        return self.call(self.get_state, GetState.Request(), read_only=True).current_state.label

    def set_parameter(self, name: str, value):
        """-> rcl_interfaces SetParametersResult (successful, reason)."""
        from rcl_interfaces.srv import SetParameters
        from rclpy.parameter import Parameter
        request = SetParameters.Request(parameters=[Parameter(name, value=value).to_parameter_msg()])
        return self.call(self.set_params, request).results[0]

    def get_parameter(self, name: str):
        from rcl_interfaces.srv import GetParameters
        from rclpy.parameter import parameter_value_to_python
        value = self.call(self.get_params, GetParameters.Request(names=[name]), read_only=True).values[0]
        return parameter_value_to_python(value)

    def close(self) -> None:
        self.stop_streams()
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()
        self._spinner.join(5)


class Robot:
    """Synthetic inputs: two cameras (raw or JPEG each) and joint states at fixed rates, each
    produced by a function a test may swap to inject malformed messages."""

    def __init__(self, harness: Harness, camera_hz: float = 15.0, joint_hz: float = 50.0,
                 size: tuple[int, int] = (480, 640), compressed: tuple = (False, False)):
        self.h = harness
        self.size = size
        self.compressed = compressed
        self.frame_count = 0
        self.joint_count = 0
        self.joints = HOME.copy()
        self.camera_messages: dict[int, Callable] = {}   # camera index -> f(camera, stamp, seq) -> msg, overrides
        self.joint_message: Optional[Callable] = None     # f(stamp) -> msg, overrides
        self.cameras_on = [True, True]
        self.joints_on = True
        # A short loop of precomputed frames keeps the test process's CPU for DDS.
        self._data = {}
        for camera in range(2):
            for k in range(FRAME_LOOP):
                frame = rgb_frame(size[0], size[1], 5 * k + 50 * camera)
                if compressed[camera]:
                    import cv2
                    self._data[camera, k] = cv2.imencode(".jpg", np.ascontiguousarray(frame[..., ::-1]))[1].tobytes()
                else:
                    self._data[camera, k] = frame.tobytes()
        harness.every(1.0 / camera_hz, self._publish_cameras)
        harness.every(1.0 / joint_hz, self._publish_joints)

    def image(self, camera: int, stamp, seq: int):
        from sensor_msgs.msg import CompressedImage, Image
        h, w = self.size
        if self.compressed[camera]:
            msg = CompressedImage(format="jpeg")
        else:
            msg = Image(height=h, width=w, encoding="rgb8", step=w * 3)
        msg.data = self._data[camera, seq % FRAME_LOOP]
        msg.header.stamp = stamp
        msg.header.frame_id = f"camera{camera}"
        return msg

    def joint_state(self, stamp):
        from sensor_msgs.msg import JointState
        msg = JointState(name=list(reversed(JOINTS)), position=[float(x) for x in reversed(self.joints)])
        msg.header.stamp = stamp
        return msg

    def _publish_cameras(self) -> None:
        stamp = self.h.stamp()
        self.frame_count += 1
        for i, topic in enumerate(CAMERA_TOPICS):
            if not self.cameras_on[i]:
                continue
            make = self.camera_messages.get(i, self.image)
            msg = make(i, stamp, self.frame_count)
            key = topic + "/compressed" if type(msg).__name__ == "CompressedImage" else topic
            self.h.camera_pubs[key].publish(msg)

    def _publish_joints(self) -> None:
        if not self.joints_on:
            return
        self.joint_count += 1
        stamp = self.h.stamp()
        msg = (self.joint_message or self.joint_state)(stamp)
        self.h.joint_pub.publish(msg)


@contextmanager
def busy_loops(n: int):
    """`n` processes spinning `while True: pass` while the block runs: a busy machine, as CI's
    (scripts/under_load.sh does the same around whole pytest runs)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        yield
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as status:
            return "zombie" not in status.read()
    except FileNotFoundError:
        return False


def diag_float(d: dict, key: str) -> float:
    return float(d[key])
