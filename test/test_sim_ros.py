"""The closed loop over ROS 2: vla-sim run publishes cameras, joint states and /clock, vla-node
(use_sim_time, random weights of a 14-joint model) commands, and the simulated arm moves.

In lockstep (`vla-sim run --lockstep`: every tick waits for the node's command, however long)
with the node's fixed_latency_s (every chunk taken the same number of ticks after its request),
nothing is left to the machine's speed: the loop commands exactly what vla-sim eval's engine-only
loop commands, on an idle machine and beside busy loops alike."""
import json
import subprocess
import sys

import numpy as np
import pytest
import torch
import yaml

from optional import require_simulator

require_simulator()

from ros_helpers import ROOT, NodeProcess, busy_loops, ros_env  # noqa: E402
from test_sim_loop import random_sim_checkpoint  # noqa: E402
from vla_node.ros import params  # noqa: E402
from vla_node.runtime import PolicyEngine  # noqa: E402
from vla_node.sim.aloha import RenderConfig, TransferCube  # noqa: E402
from vla_node.sim.closed_loop import ClosedLoop, ControlSettings  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SIM_YAML = ROOT / "config" / "sim.yaml"
SIZE = {"camera_height": 48, "camera_width": 64}
FIXED_LATENCY_S = 0.06        # 3 ticks
TICKS, EPISODES, FIRST_SEED = 60, 2, 1000


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return random_sim_checkpoint(tmp_path_factory.mktemp("policy"))


def lockstep_run(out, checkpoint, node_overrides: dict, sim_args: list[str]) -> tuple[dict, str]:
    """vla-sim run --lockstep against a vla-node (sim.yaml, use_sim_time): its report and the
    node's log."""
    node = NodeProcess({"autostart": True, "use_sim_time": True, "checkpoint": str(checkpoint), **node_overrides},
                       params_file=SIM_YAML)
    try:
        sim = subprocess.run([sys.executable, "-m", "vla_node.sim", "run", "--lockstep", "--json",
                              str(out / "run.json"), *sim_args, "--ros-args", "-r", f"__ns:={node.namespace}"],
                             env=ros_env(), capture_output=True, text=True, timeout=240)
        assert sim.returncode == 0, sim.stdout + sim.stderr
    finally:
        node.stop()
    return json.loads((out / "run.json").read_text()), node.output()


def random_weights_run(out, checkpoint) -> tuple[dict, str]:
    return lockstep_run(out, checkpoint, {"fixed_latency_s": FIXED_LATENCY_S, **SIZE},
                        ["--episodes", str(EPISODES), "--ticks", str(TICKS), "--height", "48", "--width", "64",
                         "--video-dir", str(out / "videos")])


@pytest.fixture(scope="module")
def idle_run(tmp_path_factory, checkpoint):
    out = tmp_path_factory.mktemp("idle")
    return (*random_weights_run(out, checkpoint), out)


def test_commands_reach_the_simulator_and_move_the_arm(idle_run):
    report, node_log, out = idle_run
    assert report["lockstep"]
    for episode in report["per_episode"]:
        # Every tick's command came from the node (lockstep fails the run otherwise), from the first
        # tick of each episode on (the jump back between episodes cleared the node's last command).
        assert episode["commands"] == TICKS and episode["held_without_command"] == 0, episode
        assert episode["first_command_tick"] == 0, episode
        assert episode["arm_travel_rad"] > 0.05, episode      # the node's chunks drove the arm
        assert episode["video"] and (out / "videos").exists()
    assert "clock jumped back" in node_log


def test_over_ros_in_lockstep_the_loop_is_the_engine_only_loop(idle_run, checkpoint):
    """vla-sim eval's closed loop (the engine called directly, the latency counted in sim time by
    the same rule, control.latency_ticks) commands exactly what the node commanded over DDS, tick
    for tick, in both episodes. One torch thread, as the node's engine process (engine_threads 1):
    more threads sum in another order, a difference of ~1e-6 that the loop then carries on."""
    report, _, _ = idle_run
    node_params = yaml.safe_load(SIM_YAML.read_text())["/**/vla_node"]["ros__parameters"]
    values = {name: spec.default for name, spec in params.SPECS.items()}
    values.update(node_params, checkpoint=str(checkpoint), **SIZE)
    settings = ControlSettings.from_params_file(SIM_YAML, **SIZE)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engine = PolicyEngine(params.validate(values).engine)
        engine.warmup()

        class Recording(TransferCube):
            def step(self, target):
                self.sent.append(np.array(target))
                return super().step(target)

        with Recording(RenderConfig(settings.camera_names, 48, 64)) as env:
            loop = ClosedLoop(env, engine, settings, latency_s=FIXED_LATENCY_S, ticks=TICKS)
            for i, episode in enumerate(report["per_episode"]):
                env.sent = []
                loop.run(FIRST_SEED + i)
                np.testing.assert_array_equal(np.array(episode["tick_commands"]), np.array(env.sent))
    finally:
        torch.set_num_threads(threads)


def test_a_lockstep_run_beside_busy_loops_commands_what_the_idle_run_did(idle_run, checkpoint, tmp_path):
    report, _, _ = idle_run
    with busy_loops(2):
        busy, _ = random_weights_run(tmp_path, checkpoint)
    for idle_episode, busy_episode in zip(report["per_episode"], busy["per_episode"], strict=True):
        np.testing.assert_array_equal(np.array(busy_episode["tick_commands"]), np.array(idle_episode["tick_commands"]))


# The trained default policy closed over ROS (vla_node/data/sim_policy, the engine fused, lockstep
# with its 40 ms latency) is the demo's first part: test_replay_live's
# test_the_shipped_policy_reaches_for_the_cube_over_ros checks it on the demo's run (this module
# ran the same loop a second time, for 200 ticks).


FAKE_POLICY = """
import sys
import rclpy
from diagnostic_msgs.msg import DiagnosticArray, DiagnosticStatus, KeyValue
from rclpy.node import Node
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import JointState
from vla_node.sim.aloha import JOINT_NAMES

rclpy.init(args=sys.argv)
node = Node("vla_node")
commands = node.create_publisher(JointState, "~/joint_command", 10)
diagnostics = node.create_publisher(DiagnosticArray, "/diagnostics", 10)
last = [None]

def on_clock(msg):
    ns = msg.clock.sec * 1_000_000_000 + msg.clock.nanosec
    if last[0] is not None and ns < last[0] and sys.argv[1] == "report":
        status = DiagnosticStatus(level=DiagnosticStatus.WARN, name="vla_node: policy",
                                  message="holding: clock: clock jumped back by 1 s; inputs and plan discarded",
                                  values=[KeyValue(key="state", value="active")])
        diagnostics.publish(DiagnosticArray(status=[status]))
    last[0] = ns
    command = JointState(name=list(JOINT_NAMES), position=[0.0] * len(JOINT_NAMES))
    command.header.stamp = msg.clock
    commands.publish(command)

node.create_subscription(Clock, "/clock", on_clock, 10)
rclpy.spin(node)
"""


@pytest.mark.parametrize("reports_the_jump", [True, False])
def test_lockstep_episodes_start_after_the_node_reports_the_clock_jump(tmp_path, reports_the_jump):
    """An episode's first observation waits for the node's /diagnostics report of the hold that the
    clock's jump back started: DDS keeps no order between topics, and an observation that reached
    the node before the jump was forgotten with the old episode (the node then never commanded
    its tick, and the run stopped). A stand-in node that answers every clock tick: it runs both
    episodes when it reports the jump, and the run stops with that cause when it does not."""
    namespace = f"/jump_{'report' if reports_the_jump else 'silent'}"
    fake = subprocess.Popen([sys.executable, "-c", FAKE_POLICY, "report" if reports_the_jump else "silent",
                             "--ros-args", "-r", f"__ns:={namespace}"], env=ros_env())
    try:
        sim = subprocess.run([sys.executable, "-m", "vla_node.sim", "run", "--lockstep", "--episodes", "2",
                              "--ticks", "3", "--height", "48", "--width", "64", "--lockstep-timeout-s", "5",
                              "--json", str(tmp_path / "run.json"), "--ros-args", "-r", f"__ns:={namespace}"],
                             env=ros_env(), capture_output=True, text=True, timeout=240)
    finally:
        # Killed, not terminated: it has nothing to finish, and this plain rclpy process once did not
        # end within 30 s of SIGTERM in the clean-clone CI (where it hung was not seen; vla-node bounds
        # its own exit: main.SHUTDOWN_TIMEOUT_S). The suite's fixture removes the shared memory it leaves.
        fake.kill()
        fake.wait(timeout=30)
    if reports_the_jump:
        assert sim.returncode == 0, sim.stdout + sim.stderr
        assert [e["commands"] for e in json.loads((tmp_path / "run.json").read_text())["per_episode"]] == [3, 3]
    else:
        assert sim.returncode == 1 and "did not report the clock's jump back" in sim.stderr, sim.stdout + sim.stderr
