"""launch/molmobot.launch.py under launch_pytest, as a user runs it: with autostart (the default)
the node configures and activates itself and commands; with autostart:=false every transition is
left to a lifecycle manager, and the launch file never answers one with its own; two namespaced
launches serve two robots side by side, also from one engine server that the first of them starts
(engine_server, start_engine_server); while the node configures, it answers `configuring`; the
launch ends with the node: with exit code 0 after the shutdown transition, with 1 when the node
refuses its parameters, the params file does not exist or start_engine_server has no socket.

launch_pytest comes with a ROS 2 install (the package built with colcon, so that launch_ros
finds `vla_node` in the ament index); where it is not importable these tests are skipped.
"""
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

launch_pytest = pytest.importorskip("launch_pytest", reason="launch_pytest is not installed (it comes with a "
                                                            "ROS 2 install; pip cannot provide it)")

from launch.actions import IncludeLaunchDescription, SetEnvironmentVariable  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402

from launch import LaunchDescription, LaunchService  # noqa: E402
from ros_helpers import HOME, JOINTS, ros_env  # noqa: E402
from vla_node.ros.diagnostics import Key  # noqa: E402
from vla_node.ros.engine_protocol import WARMUP_GATE_ENV  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_FILE = ROOT / "launch" / "molmobot.launch.py"
TINY = ROOT / "config" / "tiny.yaml"
pytestmark = pytest.mark.timeout(300)
HOME2 = HOME + np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, -0.1])


def include(namespace: str, **arguments) -> IncludeLaunchDescription:
    arguments = {"params_file": str(TINY), "namespace": namespace, "model_preset": "tiny", **arguments}
    return IncludeLaunchDescription(PythonLaunchDescriptionSource(str(LAUNCH_FILE)),
                                    launch_arguments=arguments.items())


class Probe:
    """A test-side node: publishes a robot's joint states, watches commands, drives lifecycles."""

    def __init__(self):
        import rclpy
        from rclpy.executors import SingleThreadedExecutor

        self.context = rclpy.Context()
        rclpy.init(context=self.context)
        self.node = rclpy.create_node("launch_test_probe", context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self.commands: dict[str, list] = {}
        self.spinner = threading.Thread(target=self.executor.spin, daemon=True)
        self.spinner.start()

    def robot(self, namespace: str, position: np.ndarray) -> None:
        """Joint states at 50 Hz on the namespace's joint_states; the node's commands recorded."""
        from rclpy.qos import qos_profile_sensor_data
        from sensor_msgs.msg import JointState
        from std_msgs.msg import Float64MultiArray

        received = self.commands.setdefault(namespace, [])
        self.node.create_subscription(Float64MultiArray, f"/{namespace}/vla_node/command",
                                      lambda msg: received.append(np.array(msg.data)), 10)
        joints = self.node.create_publisher(JointState, f"/{namespace}/joint_states", qos_profile_sensor_data)
        self.node.create_timer(0.02, lambda: joints.publish(JointState(name=JOINTS, position=position.tolist())))

    def engine(self, namespace: str, timeout: float = 60.0) -> tuple[str, str]:
        """(engine_pid, engine_server) from the namespace's node's /diagnostics."""
        from diagnostic_msgs.msg import DiagnosticArray

        found, seen = threading.Event(), {}

        def heard(msg) -> None:
            for status in msg.status:
                values = {v.key: v.value for v in status.values}
                if status.hardware_id == f"/{namespace}/vla_node" and values.get(Key.ENGINE_PID):
                    seen.update(values)
                    found.set()
        subscription = self.node.create_subscription(DiagnosticArray, "/diagnostics", heard, 10)
        try:
            assert found.wait(timeout), f"no /diagnostics with {Key.ENGINE_PID} from /{namespace}/vla_node"
        finally:
            self.node.destroy_subscription(subscription)
        return seen[Key.ENGINE_PID], seen.get(Key.ENGINE_SERVER, "")

    def call(self, service_type, name: str, request, timeout: float = 120.0):
        client = self.node.create_client(service_type, name)
        assert client.wait_for_service(timeout_sec=60.0), f"no service {name}"
        future = client.call_async(request)
        done = threading.Event()
        future.add_done_callback(lambda _: done.set())
        assert done.wait(timeout), f"no answer from {name}"
        return future.result()

    def state(self, namespace: str) -> str:
        from lifecycle_msgs.srv import GetState
        return self.call(GetState, f"/{namespace}/vla_node/get_state", GetState.Request()).current_state.label

    def transition(self, namespace: str, label: str) -> bool:
        from lifecycle_msgs.srv import ChangeState
        request = ChangeState.Request()
        request.transition.label = label
        return self.call(ChangeState, f"/{namespace}/vla_node/change_state", request).success

    def wait_active(self, namespace: str, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while (state := self.state(namespace)) != "active":   # configuring (loading the engine) first
            assert time.monotonic() < deadline, f"{namespace} is {state}, not active"
            time.sleep(0.5)

    def wait_commanding(self, namespace: str, position: np.ndarray, timeout: float = 60.0) -> None:
        """Active and told where the robot is, the node commands (holding there until chunks come)."""
        deadline = time.monotonic() + timeout
        while not any(np.allclose(c, position) for c in list(self.commands.get(namespace, []))):
            assert time.monotonic() < deadline, f"{namespace}: no command at its robot's position"
            time.sleep(0.1)

    def close(self) -> None:
        self.executor.shutdown()
        self.node.destroy_node()
        self.context.try_shutdown()
        self.spinner.join(5)


@pytest.fixture
def probe():
    p = Probe()
    yield p
    p.close()


@launch_pytest.fixture
def autostarted():
    ros_env()   # this test module's ROS domain, for the launched node too
    return LaunchDescription([include("launch_test"), launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=autostarted)
def test_launch_file_configures_and_activates_the_node(probe):
    probe.robot("launch_test", HOME)
    probe.wait_active("launch_test")
    probe.wait_commanding("launch_test", HOME)


@launch_pytest.fixture
def managed():
    ros_env()
    return LaunchDescription([include("managed", autostart="false"), launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=managed)
def test_with_autostart_false_every_transition_is_the_managers(probe):
    assert probe.state("managed") == "unconfigured"
    # What a lifecycle manager does, twice over: each transition succeeds, none is answered by the
    # launch file (which used to activate after every configure, so the manager's activate failed).
    for _ in range(2):
        assert probe.transition("managed", "configure") and probe.state("managed") == "inactive"
        assert probe.transition("managed", "activate") and probe.state("managed") == "active"
        assert probe.transition("managed", "deactivate") and probe.state("managed") == "inactive"
        assert probe.transition("managed", "cleanup") and probe.state("managed") == "unconfigured"


def serve_two_robots(probe) -> None:
    """robot1 at HOME, robot2 at HOME2: both nodes go active and command, each its own robot only."""
    probe.robot("robot1", HOME)
    probe.robot("robot2", HOME2)
    for namespace, position in (("robot1", HOME), ("robot2", HOME2)):
        probe.wait_active(namespace)
        probe.wait_commanding(namespace, position)
    assert not any(np.allclose(c, HOME2) for c in probe.commands["robot1"])
    assert not any(np.allclose(c, HOME) for c in probe.commands["robot2"])


@launch_pytest.fixture
def two_robots():
    ros_env()
    return LaunchDescription([include("robot1"), include("robot2"), launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=two_robots)
def test_two_namespaced_launches_serve_two_robots(probe):
    serve_two_robots(probe)


ENGINE_SOCKET = Path(tempfile.mkdtemp()) / "engine.sock"


@launch_pytest.fixture
def one_engine_server():
    ros_env()
    return LaunchDescription([include("robot1", engine_server=str(ENGINE_SOCKET), start_engine_server="true",
                                      batch_window_ms="5"),
                              include("robot2", engine_server=str(ENGINE_SOCKET)),
                              launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=one_engine_server)
def test_two_launches_share_the_engine_server_that_the_first_one_starts(probe):
    serve_two_robots(probe)
    # One engine: both nodes name the same process, the server on the socket.
    (pid1, server1), (pid2, server2) = probe.engine("robot1"), probe.engine("robot2")
    assert pid1 == pid2 and server1 == server2 == str(ENGINE_SOCKET)


WARMUP_GATE = Path(tempfile.mkdtemp()) / "warm-up gate"   # the node's engine warms up once this exists


@launch_pytest.fixture
def slow_configure():
    ros_env()
    return LaunchDescription([SetEnvironmentVariable(WARMUP_GATE_ENV, str(WARMUP_GATE)), include("slow"),
                              launch_pytest.actions.ReadyToTest()])


@pytest.mark.launch(fixture=slow_configure)
def test_while_the_node_configures_it_answers_configuring_and_its_parameters(probe):
    from rcl_interfaces.srv import GetParameters

    deadline = time.monotonic() + 120
    while (state := probe.state("slow")) != "configuring":      # unconfigured until the executor spins
        assert state == "unconfigured" and time.monotonic() < deadline, state
        time.sleep(0.1)
    assert probe.state("slow") == "configuring"     # answered at all: configure waits at the gate
    values = probe.call(GetParameters, "/slow/vla_node/get_parameters", GetParameters.Request(names=["autostart"]))
    assert values.values[0].bool_value
    WARMUP_GATE.touch()
    probe.wait_active("slow")


def run_launch(**arguments) -> int:
    """`ros2 launch vla_node molmobot.launch.py ARGUMENTS` in this process: its exit code."""
    service = LaunchService()
    service.include_launch_description(LaunchDescription([include("exit", **arguments)]))
    return service.run()


def test_a_node_that_refuses_its_parameters_ends_the_launch_with_exit_code_1(tmp_path):
    ros_env()
    params = tmp_path / "robot.yaml"
    params.write_text(TINY.read_text().replace("control_rate_hz: 50.0", "control_rate_hz: 15"))
    assert run_launch(params_file=str(params)) == 1    # returns: the launch did not keep running, and failed


def test_a_params_file_that_does_not_exist_stops_the_launch_with_exit_code_1(tmp_path):
    ros_env()
    assert run_launch(params_file=str(tmp_path / "my_robto.yaml")) == 1


def test_start_engine_server_without_an_engine_server_socket_stops_the_launch_with_exit_code_1():
    ros_env()
    assert run_launch(start_engine_server="true") == 1


def test_after_the_shutdown_transition_the_launch_ends_with_exit_code_0(probe):
    ros_env()

    def shut_down() -> None:
        probe.wait_active("exit")
        assert probe.transition("exit", "shutdown")

    robot = threading.Thread(target=shut_down, daemon=True)
    robot.start()
    assert run_launch() == 0          # launch runs in the main thread (its signal handling needs it)
    robot.join(60)
