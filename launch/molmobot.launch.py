"""Start the vla_node lifecycle node.

    ros2 launch vla_node molmobot.launch.py checkpoint:=/path/to/MolmoBot-DROID   # configure + activate at start
    ros2 launch vla_node molmobot.launch.py autostart:=false     # transitions from a lifecycle manager or you
    ros2 launch vla_node molmobot.launch.py params_file:=/path/to/tiny.yaml model_preset:=tiny \\
        namespace:=robot1 use_sim_time:=true log_level:=debug
    # two robots, one engine (one copy of the weights): robot1's launch starts the server, robot2 attaches
    ros2 launch vla_node molmobot.launch.py namespace:=robot1 engine_server:=/tmp/vla_engine.sock \\
        start_engine_server:=true
    ros2 launch vla_node molmobot.launch.py namespace:=robot2 engine_server:=/tmp/vla_engine.sock

autostart:=true sets the node's `autostart` parameter: the node configures and activates itself
once, as soon as it spins (a failed configure stays unconfigured, with the reason in the log and on
/diagnostics). This file sends no lifecycle transitions, so later ones (a manager's, or
`ros2 lifecycle set`) are never answered with one of its own. Input topics are relative, so
`namespace:=robot1` moves the inputs (/robot1/joint_states, ...) and the outputs
(/robot1/vla_node/...) alike.

engine_server:=PATH sets the node's `engine_server` parameter: it attaches to the vla-engine-server
on the Unix socket PATH (its configure waits for the socket, up to engine_start_timeout_s) instead
of starting an engine process of its own; start_engine_server:=true also starts that server here
(batch_window_ms:=MS sets its batching window; empty: the server's default, 2 ms).

The launch ends when the node exits: after the shutdown transition (exit_on_finalize), on Ctrl-C,
or when it cannot start. `ros2 launch` then exits 0 if the node did, else 1 (launch returns 1 when
an action raises, and the exit handler raises for a non-zero exit code); a params_file that is not
a file stops it at once with 1 (launch_ros would only warn and start the node on its built-in
defaults).
"""
from pathlib import Path

from launch.actions import DeclareLaunchArgument, ExecuteProcess, OpaqueFunction, Shutdown
from launch.substitutions import LaunchConfiguration, PathJoinSubstitution
from launch_ros.actions import LifecycleNode
from launch_ros.parameter_descriptions import ParameterValue
from launch_ros.substitutions import ExecutableInPackage, FindPackageShare

from launch import LaunchDescription


def _node(context):
    params_file = LaunchConfiguration("params_file").perform(context)
    if not Path(params_file).is_file():
        raise RuntimeError(f"params_file {params_file!r} is not a file: give the path of a parameters YAML, e.g. "
                           "$(ros2 pkg prefix vla_node)/share/vla_node/config/tiny.yaml")
    overrides = {"autostart": ParameterValue(LaunchConfiguration("autostart"), value_type=bool),
                 "use_sim_time": ParameterValue(LaunchConfiguration("use_sim_time"), value_type=bool)}
    engine_server = LaunchConfiguration("engine_server").perform(context)
    start_server = LaunchConfiguration("start_engine_server").perform(context).lower() in ("true", "1")
    if start_server and not engine_server:
        raise RuntimeError("start_engine_server:=true needs engine_server:=PATH, the socket the server listens on "
                           "(e.g. engine_server:=/tmp/vla_engine.sock)")
    # An empty model_preset, checkpoint or engine_server keeps the params file's.
    for name in ("model_preset", "checkpoint", "engine_server"):
        if LaunchConfiguration(name).perform(context):
            overrides[name] = LaunchConfiguration(name)
    # From the package's lib folder, where a colcon install puts it (not on PATH), as LifecycleNode finds vla-node.
    window = LaunchConfiguration("batch_window_ms").perform(context)
    server_cmd = [ExecutableInPackage("vla-engine-server", "vla_node"), "--socket", engine_server]
    server_cmd += ["--batch-window-ms", window] if window else []
    server = [ExecuteProcess(cmd=server_cmd, name="vla_engine_server", output="screen")] if start_server else []
    return server + [LifecycleNode(
        package="vla_node", executable="vla-node", name="vla_node",
        namespace=LaunchConfiguration("namespace"),
        parameters=[params_file, overrides],
        ros_arguments=["--log-level", LaunchConfiguration("log_level")],
        output="screen", emulate_tty=True, on_exit=_on_node_exit)]


def _on_node_exit(event, context):
    """The node exits only when told to or when it cannot run: either way this launch is done, and
    failed if the node did."""
    if event.returncode != 0:
        raise RuntimeError(f"vla_node exited with code {event.returncode} (its log above says why)")
    if not context.is_shutdown:     # ending already: a second shutdown makes launch_ros raise
        return [Shutdown(reason="vla_node exited")]
    return None


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
        DeclareLaunchArgument("engine_server", default_value="",
                              description="Unix socket of a vla-engine-server to attach to (one engine for several "
                                          "nodes); empty: the params file's (by default the node's own engine)"),
        DeclareLaunchArgument("start_engine_server", default_value="false",
                              description="true: also start `vla-engine-server --socket <engine_server>` here"),
        DeclareLaunchArgument("batch_window_ms", default_value="",
                              description="the started server's batching window (--batch-window-ms): how long a "
                                          "query waits for other robots' to batch with; empty: the server's default"),
        DeclareLaunchArgument("use_sim_time", default_value="false", description="follow /clock"),
        DeclareLaunchArgument("log_level", default_value="info",
                              description="log level of the node: debug, info, warn, error or fatal"),
        OpaqueFunction(function=_node),
    ])
