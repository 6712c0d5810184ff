"""launch/molmobot.launch.py under launch_pytest: the launch file starts the node with the tiny
configuration and its lifecycle events bring it to active, where it commands.

launch_pytest comes with a ROS 2 install (the package built with colcon, so that launch_ros
finds `vla_node` in the ament index); where it is not importable this test is skipped.
"""
import threading
import time
from pathlib import Path

import pytest

launch_pytest = pytest.importorskip("launch_pytest", reason="launch_pytest is not installed (it comes with a "
                                                            "ROS 2 install; pip cannot provide it)")

from launch import LaunchDescription  # noqa: E402
from launch.actions import IncludeLaunchDescription  # noqa: E402
from launch.launch_description_sources import PythonLaunchDescriptionSource  # noqa: E402

from ros_helpers import HOME, JOINTS, ros_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NAMESPACE = "launch_test"


@launch_pytest.fixture
def launch_description():
    ros_env()   # this test's own ROS domain, for the launched node too
    return LaunchDescription([
        IncludeLaunchDescription(
            PythonLaunchDescriptionSource(str(ROOT / "launch" / "molmobot.launch.py")),
            launch_arguments={"params_file": str(ROOT / "config" / "tiny.yaml"), "namespace": NAMESPACE,
                              "model_preset": "tiny", "use_sim_time": "false"}.items()),
        launch_pytest.actions.ReadyToTest(),
    ])


@pytest.mark.launch(fixture=launch_description)
def test_launch_file_configures_and_activates_the_node():
    import rclpy
    from lifecycle_msgs.srv import GetState
    from rclpy.executors import SingleThreadedExecutor
    from rclpy.qos import qos_profile_sensor_data
    from sensor_msgs.msg import JointState
    from std_msgs.msg import Float64MultiArray

    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("launch_test_probe", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    spinner = threading.Thread(target=executor.spin, daemon=True)
    spinner.start()
    commanded = threading.Event()
    try:
        node.create_subscription(Float64MultiArray, f"/{NAMESPACE}/vla_node/command",
                                 lambda msg: commanded.set() if len(msg.data) == len(JOINTS) else None, 10)
        joints = node.create_publisher(JointState, "/joint_states", qos_profile_sensor_data)
        node.create_timer(0.02, lambda: joints.publish(JointState(name=JOINTS, position=HOME.tolist())))
        client = node.create_client(GetState, f"/{NAMESPACE}/vla_node/get_state")
        assert client.wait_for_service(timeout_sec=60.0)
        deadline = time.monotonic() + 120.0
        state = ""
        while state != "active" and time.monotonic() < deadline:
            future = client.call_async(GetState.Request())
            done = threading.Event()
            future.add_done_callback(lambda _: done.set())
            assert done.wait(10.0)
            state = future.result().current_state.label
            if state != "active":   # configuring (loading the engine) or about to activate
                commanded.wait(1.0)
        assert state == "active"
        # Active and told where the robot is: it commands (holding there until chunks come).
        assert commanded.wait(30.0)
    finally:
        executor.shutdown()
        node.destroy_node()
        context.try_shutdown()
        spinner.join(5)
