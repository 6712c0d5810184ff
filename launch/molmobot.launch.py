"""Start the vla_node lifecycle node.

    ros2 launch vla_node molmobot.launch.py checkpoint:=/path/to/MolmoBot-DROID   # configure + activate at start
    ros2 launch vla_node molmobot.launch.py autostart:=false     # transitions from a lifecycle manager or you
    ros2 launch vla_node molmobot.launch.py params_file:=/path/to/tiny.yaml model_preset:=tiny \\
        namespace:=robot1 use_sim_time:=true log_level:=debug

autostart:=true sets the node's `autostart` parameter: the node configures and activates itself
once, at start (a failed configure stays unconfigured, with the reason in the log and on
/diagnostics). This file sends no lifecycle transitions, so later ones (a manager's, or
`ros2 lifecycle set`) are never answered with one of its own. The launch ends when the node exits
(e.g. on start-up parameters it refuses). Input topics are relative, so `namespace:=robot1` moves
the inputs (/robot1/joint_states, ...) and the outputs (/robot1/vla_node/...) alike.
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction, Shutdown
from launch.condition import Condition
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare


def _node(context):
    overrides = {"autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool),
                 "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool)}
    # An empty model_preset or checkpoint keeps the params file's.
    for name in ("model_preset", "checkpoint"):
        if LaunchConfiguration(name).perform(context):
            overrides[name] = LaunchConfiguration(name)
    return [LifecycleNode(
        package="vla_node", executable="vla-node", name="vla_node",
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration("params_file"), overrides],
        ros_arguments=["--log-level", LaunchConfiguration("log_level")],
        output="screen", emulate_tty=True,
        # The node exits only when told to or when it cannot run: either way this launch is done
        # (unless it is ending already: a second shutdown makes launch_ros raise).
        on_exit=[Shutdown(reason="vla_node exited", condition=Condition(predicate=lambda c: not c.is_shutdown))])]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file",
            default_value=PathJoinSubstitution([FindPackageShare("vla_node"), "config", "molmobot.yaml"]),
            description="parameters of the node (config/molmobot.yaml: MolmoBot-DROID on a GPU; "
                        "config/tiny.yaml: the tiny model on the CPU)"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node and its topics"),
        DeclareLaunchArgument("autostart", default_value="true",
                              description="true: configure and activate at start; false: leave every lifecycle "
                                          "transition to a lifecycle manager or the user"),
        DeclareLaunchArgument("model_preset", default_value="",
                              description="model preset overriding the params file's (e.g. tiny, molmobot-4b); "
                                          "empty: the file's"),
        DeclareLaunchArgument("checkpoint", default_value="",
                              description="checkpoint folder overriding the params file's; empty: the file's"),
        DeclareLaunchArgument("use_sim_time", default_value="false", description="follow /clock"),
        DeclareLaunchArgument("log_level", default_value="info",
                              description="log level of the node: debug, info, warn, error or fatal"),
        OpaqueFunction(function=_node),
    ])
