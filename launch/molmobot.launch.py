"""Start the vla_node lifecycle node and bring it to active: configure it, then activate it once
configuring has ended in inactive (a failed configure stays unconfigured, with the reason in the
log and on /diagnostics). Every configure activates, also a manual one after cleanup; a manual
deactivate stays inactive.

    ros2 launch vla_node molmobot.launch.py
    ros2 launch vla_node molmobot.launch.py params_file:=/path/to/tiny.yaml model_preset:=tiny \\
        namespace:=robot1 use_sim_time:=true
"""
from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, EmitEvent, OpaqueFunction, RegisterEventHandler
from launch.events import matches_action
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.event_handlers import OnStateTransition
from launch_ros.events.lifecycle import ChangeState
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import FindPackageShare
from lifecycle_msgs.msg import Transition


def _node_and_transitions(context):
    overrides = {"use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool)}
    # An empty model_preset keeps the params file's preset.
    if LaunchConfiguration("model_preset").perform(context):
        overrides["model_preset"] = LaunchConfiguration("model_preset")
    node = LifecycleNode(
        package="vla_node", executable="vla_node", name="vla_node",
        namespace=LaunchConfiguration("namespace"),
        parameters=[LaunchConfiguration("params_file"), overrides],
        output="screen", emulate_tty=True)
    configure = EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                            transition_id=Transition.TRANSITION_CONFIGURE))
    # Only after configuring: a later deactivate (also ending in inactive) must not re-activate.
    activate_when_configured = RegisterEventHandler(OnStateTransition(
        target_lifecycle_node=node, start_state="configuring", goal_state="inactive",
        entities=[EmitEvent(event=ChangeState(lifecycle_node_matcher=matches_action(node),
                                              transition_id=Transition.TRANSITION_ACTIVATE))]))
    return [activate_when_configured, node, configure]


def generate_launch_description():
    return LaunchDescription([
        DeclareLaunchArgument(
            "params_file",
            default_value=PathJoinSubstitution([FindPackageShare("vla_node"), "config", "molmobot.yaml"]),
            description="parameters of the node (config/molmobot.yaml: MolmoBot-DROID on a GPU; "
                        "config/tiny.yaml: the tiny model on the CPU)"),
        DeclareLaunchArgument("namespace", default_value="", description="namespace of the node"),
        DeclareLaunchArgument("model_preset", default_value="",
                              description="model preset overriding the params file's (e.g. tiny, molmobot-4b); "
                                          "empty: the file's"),
        DeclareLaunchArgument("use_sim_time", default_value="false", description="follow /clock"),
        OpaqueFunction(function=_node_and_transitions),
    ])
