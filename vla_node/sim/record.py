"""Scripted demonstrations -> rosbag2 (MCAP), one bag per episode, through the project's bag
writer (vla_node.tools.bag_io), so training data and replay read the same way the node does.

One bag per episode: an episode is the unit a trainer shuffles, holds out and filters by
success, and the unit that fails (a crash loses one file, not the set); each bag replays into
the node on its own (`vla-replay live`), and the stamps can start at the same sim time in every
bag, as the simulator's clock does at every reset.

What a bag holds (the node's input topics, stamped with sim time):
    /joint_states                    sensor_msgs/JointState  every tick (50 Hz): the 14 joints
    /cameras/<name>/image_raw[/compressed]  Image or JPEG CompressedImage, every camera_every ticks
    /instruction                     std_msgs/String         once, first
    /expert/joint_command            sensor_msgs/JointState  every tick: the command held until the next tick
    /reference/joint_trajectory      trajectory_msgs/JointTrajectory  optional: per frame of the first
                                     camera, the next reference_horizon commands (vla-replay offline
                                     compares a policy's chunks with them)
Within a tick the log times follow what a node would receive: the joint state, the cameras with
the first camera last (its frame triggers a query, as in the node), then the command.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np

from ..tools.bag_io import (
    DEMO_COMMAND_TOPIC,
    INSTRUCTION_TOPIC,
    JOINT_STATE,
    JOINT_STATES_TOPIC,
    JOINT_TRAJECTORY,
    REFERENCE_TOPIC,
    STRING,
    BagWriter,
    joint_state_msg,
    joint_trajectory_msg,
    string_msg,
)
from .aloha import CONTROL_PERIOD_NS, INSTRUCTION, JOINT_NAMES, RenderConfig, SimState, TransferCube
from .expert import EPISODE_TICKS, expert_trajectory, replay

# Log time after the stamp, per message kind: the order a node would receive them in.
JOINT_STATE_DELAY_NS = 100_000
CAMERA_DELAY_NS = 200_000          # + 10 us per camera, the first camera last
COMMAND_DELAY_NS = 500_000


def camera_topic(camera: str) -> str:
    """The raw image topic of a simulated camera (a bag holds `<topic>/compressed` for JPEG)."""
    return f"/cameras/{camera}/image_raw"


@dataclass(frozen=True)
class RecordConfig:
    render: RenderConfig = RenderConfig()
    camera_every: int = 1                 # a camera frame every this many ticks (1: 50 Hz)
    jpeg_quality: Optional[int] = 85      # None: raw rgb8 Image
    ticks: int = EPISODE_TICKS
    reference_horizon: int = 0            # 0: no /reference/joint_trajectory

    def __post_init__(self):
        if self.camera_every < 1 or self.ticks < 1 or self.reference_horizon < 0:
            raise ValueError("camera_every and ticks must be >= 1, reference_horizon >= 0")


@dataclass
class EpisodeRecord:
    seed: int
    success: bool
    first_success_tick: Optional[int]
    ticks: int
    path: str
    bytes: int


def record_episode(env: TransferCube, seed: int, path: str | Path,
                   config: RecordConfig = RecordConfig()) -> EpisodeRecord:
    """Run the scripted expert for `seed` in `env` (whose RenderConfig sets the cameras) and write
    the episode to `path` (a .mcap file, or a bag directory)."""
    cameras = env.render_config.cameras
    frame_order = list(reversed(cameras))          # the first camera last
    commands = expert_trajectory(seed, config.ticks)
    with BagWriter(path) as writer:
        def on_tick(state: SimState, command: Optional[np.ndarray]) -> None:
            t = state.stamp_ns
            if state.tick == 0:
                writer.write(INSTRUCTION_TOPIC, STRING, t, string_msg(INSTRUCTION))
            writer.write(JOINT_STATES_TOPIC, JOINT_STATE, t + JOINT_STATE_DELAY_NS,
                         joint_state_msg(t, JOINT_NAMES, state.qpos))
            if state.tick % config.camera_every == 0:
                images = env.render()
                for i, camera in enumerate(frame_order):
                    writer.write_image(camera_topic(camera), t + CAMERA_DELAY_NS + 10_000 * i, images[camera], t,
                                       f"{camera}_camera", config.jpeg_quality)
                if config.reference_horizon:
                    upcoming = commands[state.tick:state.tick + config.reference_horizon]
                    if len(upcoming):
                        writer.write(REFERENCE_TOPIC, JOINT_TRAJECTORY, t + CAMERA_DELAY_NS + 10_000 * len(cameras),
                                     joint_trajectory_msg(t, JOINT_NAMES, upcoming, CONTROL_PERIOD_NS))
            if command is not None:
                writer.write(DEMO_COMMAND_TOPIC, JOINT_STATE, t + COMMAND_DELAY_NS,
                             joint_state_msg(t, JOINT_NAMES, command))

        episode = replay(env, seed, commands, on_tick)
    path = Path(path)
    size = path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*"))
    return EpisodeRecord(seed, episode.success, episode.first_success_tick, config.ticks, str(path), size)


def write_manifest(records: list[EpisodeRecord], path: str | Path, config: RecordConfig) -> None:
    """episodes.json beside the bags: the settings and every episode's seed, success and size."""
    Path(path).write_text(json.dumps({
        "task": "gym-aloha AlohaTransferCube-v0 (vla_node.sim.aloha)", "instruction": INSTRUCTION,
        "joint_names": list(JOINT_NAMES), "control_period_ns": CONTROL_PERIOD_NS,
        "config": asdict(config), "episodes": [asdict(r) for r in records],
    }, indent=2) + "\n")

