"""`vla-sim run`: the simulator as a ROS 2 node, the clock of a closed loop with vla_node.

    publishes  cameras/<name>/image_raw  sensor_msgs/Image (rgb8), every camera_every ticks
               joint_states              sensor_msgs/JointState, every tick (the 14 joints)
               instruction               std_msgs/String, at every episode start
               /clock                    rosgraph_msgs/Clock: sim time, one 20 ms tick at a time
    subscribes vla_node/command          std_msgs/Float64MultiArray: the node's 14-D command
               vla_node/joint_command    sensor_msgs/JointState: the same, stamped (--lockstep)

Topic names are relative: started in the node's namespace, nothing needs remapping.

In step with sim time: at each tick the simulator publishes the observations stamped with the
tick's time, then the clock; the node (use_sim_time) runs its control tick on that clock message
and publishes the tick's command, which the simulator holds for the tick. Two ways to wait:

- paced (the default): a command that does not come within command_timeout_s (wall time) is
  replaced by holding the last one, and counted. Sim time advances no faster than `rate` times
  the wall clock, so the policy's inference, which runs in wall time while the node keeps
  ticking, costs the sim time it would cost a robot at that rate; a slow machine runs slower, and
  a busy one gives the policy more or fewer ticks per inference.
- lockstep (--lockstep): every tick waits for the command the node stamped with the tick's time
  (its ~/joint_command: publish_joint_command true), however long that takes, and the run ends
  with an error after lockstep_timeout_s without it; there is no wall-clock pacing. With the
  node's fixed_latency_s, which fixes the inference's cost in ticks, the closed loop is the same
  on any machine, however slow or busy. Before the first episode the clock runs with joint states
  only, so that the node sends its engine nothing before it and every episode starts alike.

Each episode restarts the clock at the same time (EPISODE_START_NS): the node sees the clock
jump back and forgets the last episode's frames, joints, plan and command. In lockstep the
episode's first observation waits until the node's /diagnostics reports that hold: DDS keeps no
order between topics, so an observation published right after the jump could reach the node
before it and be forgotten with the old episode, and the node would never command its tick (seen
once in 50 episodes on the busy 2-core VM). Before the first episode the clock runs with the
robot at rest until the node commands.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import rclpy
from builtin_interfaces.msg import Time
from diagnostic_msgs.msg import DiagnosticArray
from rclpy.executors import ExternalShutdownException, SingleThreadedExecutor
from rclpy.node import Node
from rclpy.qos import DurabilityPolicy, QoSProfile, qos_profile_sensor_data
from rosgraph_msgs.msg import Clock
from sensor_msgs.msg import Image, JointState
from std_msgs.msg import Float64MultiArray, String

from ..ros.loop import CLOCK_JUMPED_BACK
from ..tools.node_process import frame_transport
from .aloha import CONTROL_PERIOD_NS, GRIPPERS, JOINT_NAMES, RenderConfig, SimState, TransferCube
from .closed_loop import ControlSettings, wilson_interval
from .video import annotate, write_video

# Lockstep: ticks the clock runs while the node commands on ~/command but nothing arrives on
# ~/joint_command (DDS discovery of that topic takes a few ticks at most).
LOCKSTEP_DISCOVERY_TICKS = 250


def time_msg(ns: int) -> Time:
    return Time(sec=ns // 1_000_000_000, nanosec=ns % 1_000_000_000)


@dataclass
class EpisodeReport:
    seed: int
    success: bool = False
    first_success_tick: Optional[int] = None
    max_reward: int = 0
    ticks: int = 0
    commands: int = 0               # ticks whose command came from the node
    held_without_command: int = 0   # ticks that waited command_timeout_s in vain
    arm_travel_rad: float = 0.0     # largest change of an arm joint from its start position
    gripper_to_cube_start_m: float = 0.0   # the right gripper's distance to the cube at the start
    gripper_to_cube_min_m: float = 0.0     # ... and the closest it came
    wall_s: float = 0.0
    video: Optional[str] = None
    first_command_tick: Optional[int] = None
    node_report: dict = field(default_factory=dict)  # the node's last /diagnostics values (latency, rate)
    tick_commands: list = field(default_factory=list)  # [ticks][14] the command held at each tick


class SimNode(Node):
    def __init__(self, cameras: tuple[str, ...], command_topic: str, joint_command_topic: Optional[str] = None):
        super().__init__("vla_sim")
        self.clock_pub = self.create_publisher(Clock, "/clock", 10)
        self.joint_pub = self.create_publisher(JointState, "joint_states", qos_profile_sensor_data)
        self.camera_pubs = {c: self.create_publisher(Image, f"cameras/{c}/image_raw", qos_profile_sensor_data)
                            for c in cameras}
        self.instruction_pub = self.create_publisher(String, "instruction",
                                                     QoSProfile(depth=1, durability=DurabilityPolicy.TRANSIENT_LOCAL))
        self.create_subscription(Float64MultiArray, command_topic, self._on_command, 10)
        # The node's own report of its latency and rate, kept for the episode summary.
        self.create_subscription(DiagnosticArray, "/diagnostics", self._on_diagnostics, 10)
        self.node_report: dict[str, str] = {}
        self.node_status = ""
        self.clock_jumps_heard = 0   # the node's reports of a hold for a clock jump
        self.commands_received = 0
        self.command: Optional[np.ndarray] = None
        self.stamped: dict[int, np.ndarray] = {}   # lockstep: the node's commands by stamp (the tick's time)
        self._bad_command_logged = False
        if joint_command_topic is not None:
            self.create_subscription(JointState, joint_command_topic, self._on_joint_command, 10)

    def _usable(self, data: np.ndarray) -> bool:
        if data.shape == (len(JOINT_NAMES),) and np.all(np.isfinite(data)):
            return True
        if not self._bad_command_logged:
            self.get_logger().error(f"command with {data.size} values (or non-finite) ignored: the simulator "
                                    f"takes {len(JOINT_NAMES)} joint positions")
            self._bad_command_logged = True
        return False

    def _on_command(self, msg: Float64MultiArray) -> None:
        data = np.asarray(msg.data, np.float64)
        if self._usable(data):
            self.command = data
            self.commands_received += 1

    def _on_joint_command(self, msg: JointState) -> None:
        data = np.asarray(msg.position, np.float64)
        if tuple(msg.name) != JOINT_NAMES:
            data = np.zeros(0)      # another robot's joints: unusable
        if self._usable(data):
            self.stamped[msg.header.stamp.sec * 1_000_000_000 + msg.header.stamp.nanosec] = data

    def _on_diagnostics(self, msg: DiagnosticArray) -> None:
        for status in msg.status:
            if status.name.split(":")[0].strip().endswith("vla_node") and status.values:
                self.node_report = {kv.key: kv.value for kv in status.values}
                self.node_status = status.message
                self.clock_jumps_heard += status.message.startswith("holding") and CLOCK_JUMPED_BACK in status.message

    def publish_observation(self, state: SimState, images: Optional[dict[str, np.ndarray]]) -> None:
        """Joint state, then the cameras with the first camera last (its frame triggers the
        node's query), all stamped with the tick's time."""
        stamp = time_msg(state.stamp_ns)
        joints = JointState(name=list(JOINT_NAMES), position=state.qpos.tolist())
        joints.header.stamp = stamp
        self.joint_pub.publish(joints)
        for camera in reversed(list(images or ())):
            rgb = images[camera]
            msg = Image(height=rgb.shape[0], width=rgb.shape[1], encoding="rgb8", step=rgb.shape[1] * 3,
                        data=rgb.tobytes())
            msg.header.stamp = stamp
            msg.header.frame_id = f"{camera}_camera"
            self.camera_pubs[camera].publish(msg)

    def publish_clock(self, ns: int) -> None:
        self.clock_pub.publish(Clock(clock=time_msg(ns)))


class Simulation:
    """Drives SimNode through episodes; spins its executor while it waits."""

    def __init__(self, node: SimNode, executor: SingleThreadedExecutor, env: TransferCube, args,
                 settings: ControlSettings):
        self.node, self.executor, self.env, self.args, self.settings = node, executor, env, args, settings
        self.period_s = CONTROL_PERIOD_NS / 1e9
        self._paced_since: Optional[float] = None
        self._paced_ticks = 0

    def _pace(self) -> None:
        """Sim time no faster than `rate` x wall time."""
        if self._paced_since is None:
            self._paced_since = time.monotonic()
        self._paced_ticks += 1
        due = self._paced_since + self._paced_ticks * self.period_s / self.args.rate
        while (wait := due - time.monotonic()) > 0:
            self.executor.spin_once(timeout_sec=wait)

    def _spin_until(self, done, timeout_s: float) -> bool:
        """Spin the executor until done() or timeout_s of wall time has passed; whether done()."""
        deadline = time.monotonic() + timeout_s
        while not done():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.executor.spin_once(timeout_sec=left)
        return True

    def _wait_command(self, before: int, timeout_s: float) -> bool:
        return self._spin_until(lambda: self.node.commands_received != before, timeout_s)

    def _lockstep_timeout(self, what: str) -> TimeoutError:
        return TimeoutError(f"--lockstep: {what} within {self.args.lockstep_timeout_s:g} s (--lockstep-timeout-s); "
                            f"the node's last status: {self.node.node_status or 'none heard'}")

    def _wait_stamped(self, stamp_ns: int, seed: int, tick: int) -> np.ndarray:
        """Lockstep: the node's command stamped `stamp_ns`, however long it takes up to
        lockstep_timeout_s (then TimeoutError); the commands of earlier ticks are dropped."""
        if not self._spin_until(lambda: stamp_ns in self.node.stamped, self.args.lockstep_timeout_s):
            raise self._lockstep_timeout(f"no command stamped with tick {tick} of episode seed {seed}")
        command = self.node.stamped.pop(stamp_ns)
        self.node.stamped.clear()
        return command

    def _wait_jump_heard(self, before: int, seed: int) -> None:
        """Lockstep: until the node reports the hold for the clock jump (see the module's docstring)."""
        if not self._spin_until(lambda: self.node.clock_jumps_heard != before, self.args.lockstep_timeout_s):
            raise self._lockstep_timeout(f"the node did not report the clock's jump back on /diagnostics before "
                                         f"episode seed {seed}")

    def wait_for_node(self) -> None:
        """Run the clock with the robot at rest (seed of the first episode) until the node
        commands: it has configured, activated and seen joint states. In lockstep without camera
        frames: the node sends its engine nothing before the first episode."""
        lockstep = self.args.lockstep
        state = self.env.reset(self.args.first_seed)
        images = None if lockstep else self.env.render()
        deadline = time.monotonic() + self.args.node_timeout_s
        self.node.get_logger().info("running the clock until the node commands")
        tick, commanding_since = 0, None
        while not (self.node.stamped if lockstep else self.node.commands_received):
            if time.monotonic() > deadline:
                raise TimeoutError(f"no command within {self.args.node_timeout_s:g} s: is vla-node running in this "
                                   f"namespace with use_sim_time:=true and active (autostart:=true)?")
            if self.node.commands_received and commanding_since is None:
                commanding_since = tick
            if commanding_since is not None and tick - commanding_since > LOCKSTEP_DISCOVERY_TICKS:
                raise TimeoutError(f"the node commands, but not on {self.args.joint_command_topic}: --lockstep needs "
                                   "vla-node with publish_joint_command:=true (it matches each tick's command by "
                                   "its stamp)")
            self.node.publish_observation(SimState(tick, state.stamp_ns + tick * CONTROL_PERIOD_NS, state.qpos,
                                                   state.reward, False), images)
            self.node.instruction_pub.publish(String(data=self.settings.instruction))
            self.node.publish_clock(state.stamp_ns + tick * CONTROL_PERIOD_NS)
            tick += 1
            self._pace()

    def episode(self, seed: int) -> EpisodeReport:
        args, node, env = self.args, self.node, self.env
        report = EpisodeReport(seed)
        frames = [] if args.video_dir else None
        state = env.reset(seed)
        start_q = state.qpos.copy()
        report.gripper_to_cube_start_m = report.gripper_to_cube_min_m = env.right_gripper_to_cube_m()
        last: Optional[np.ndarray] = None
        node.instruction_pub.publish(String(data=self.settings.instruction))
        # The clock jumps back one tick before the episode's first observation: the node forgets
        # the last episode on the jump, not the first observation of this one.
        jumps = node.clock_jumps_heard
        node.publish_clock(state.stamp_ns - CONTROL_PERIOD_NS)
        if args.lockstep:
            self._wait_jump_heard(jumps, seed)
        else:
            self._pace()
        t0 = time.monotonic()
        for tick in range(args.ticks):
            images = env.render() if tick % args.camera_every == 0 else None
            node.publish_observation(state, images)
            before = node.commands_received
            node.publish_clock(state.stamp_ns)
            received = True
            if args.lockstep:
                last = self._wait_stamped(state.stamp_ns, seed, tick)
            elif self._wait_command(before, args.command_timeout_s):
                last = node.command
            else:
                received = False
            if received:
                report.commands += 1
                if report.first_command_tick is None:
                    report.first_command_tick = tick
            else:
                report.held_without_command += 1
            command = last if last is not None else state.qpos
            report.tick_commands.append(command.tolist())
            if frames is not None and images is not None:
                frames.append(annotate(images[env.render_config.cameras[0]], command, state.qpos, JOINT_NAMES,
                                       np.asarray(self.settings.joint_lower_limits),
                                       np.asarray(self.settings.joint_upper_limits),
                                       f"seed {seed} t {tick * self.period_s:.2f}s r{state.reward}"
                                       f"{' success' if state.success else ''}"))
            if not args.lockstep:
                self._pace()
            state = env.step(command)
            report.ticks = tick + 1
            report.max_reward = max(report.max_reward, state.reward)
            arm = [j for j in range(len(JOINT_NAMES)) if j not in GRIPPERS]
            report.arm_travel_rad = max(report.arm_travel_rad, float(np.abs(state.qpos - start_q)[arm].max()))
            report.gripper_to_cube_min_m = min(report.gripper_to_cube_min_m, env.right_gripper_to_cube_m())
            if state.success and not report.success:
                report.success, report.first_success_tick = True, state.tick
                if not args.run_on:
                    break
        report.wall_s = time.monotonic() - t0
        report.node_report = dict(node.node_report)
        if frames:
            report.video = str(write_video(Path(args.video_dir) / f"episode_seed{seed}", frames,
                                           1e9 / CONTROL_PERIOD_NS / args.camera_every))
        return report


def run(args, ros_args: list[str]) -> int:
    settings = ControlSettings.from_params_file(args.params)
    render = RenderConfig(cameras=tuple(args.cameras or settings.camera_names),
                          height=args.height or settings.camera_height, width=args.width or settings.camera_width,
                          shadows=args.shadows)
    frame_transport()      # raw frames over shared memory (the camera side of the loop)
    rclpy.init(args=["vla-sim", *ros_args])
    node = None
    try:
        node = SimNode(render.cameras, args.command_topic, args.joint_command_topic if args.lockstep else None)
        executor = SingleThreadedExecutor()
        executor.add_node(node)
        log = node.get_logger()
        with TransferCube(render) as env:
            sim = Simulation(node, executor, env, args, settings)
            sim.wait_for_node()
            log.info("the node commands: starting episodes")
            reports = []
            for i in range(args.episodes):
                report = sim.episode(args.first_seed + i)
                reports.append(report)
                log.info(f"episode {i + 1}/{args.episodes} seed {report.seed}: "
                         f"{'SUCCESS' if report.success else 'failure'} (reward {report.max_reward}, "
                         f"{report.ticks} ticks in {report.wall_s:.1f} s wall, {report.commands} commands, "
                         f"{report.held_without_command} ticks without one)"
                         + (f", video {report.video}" if report.video else ""))
        wins = sum(r.success for r in reports)
        low, high = wilson_interval(wins, len(reports))
        summary = {"episodes": len(reports), "successes": wins, "success_rate": wins / max(1, len(reports)),
                   "success_ci95": [low, high], "rate": None if args.lockstep else args.rate,
                   "lockstep": args.lockstep, "per_episode": [asdict(r) for r in reports]}
        print(f"vla-sim: {wins}/{len(reports)} episodes succeeded", flush=True)
        if args.json:
            Path(args.json).parent.mkdir(parents=True, exist_ok=True)
            Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
        return 0
    except TimeoutError as err:
        print(f"vla-sim run: {err}", file=sys.stderr)
        return 1
    except (KeyboardInterrupt, ExternalShutdownException):
        return 0
    finally:
        if node is not None:
            node.destroy_node()
        rclpy.try_shutdown()
