"""The scripted expert for transfer-cube, after ACT's recipe (Zhao et al. 2023, scripted_policy.py
and record_sim_episodes.py; this is our own code).

1. End-effector space: gym-aloha's mocap model (bimanual_viperx_end_effector_transfer_cube.xml)
   welds a mocap body to each gripper. Waypoints for both grippers (position, orientation,
   opening) at fixed ticks are interpolated linearly and drive the mocap bodies; the arms follow
   through the welds, MuJoCo doing the inverse kinematics.
2. Joint space: the joint angles the arms reached at every tick, with the commanded gripper
   openings, become a 14-D joint-position trajectory, replayed open loop in the joint-space
   environment (aloha.TransferCube) from the same cube placement. That replay is the
   demonstration: its commands are what a policy has to learn.

What differs from ACT, and why. ACT pins MuJoCo 2.3.7 and its mocap scripts break on MuJoCo 3
(tonyzhaozh/act#45). Under MuJoCo 3.8 gym-aloha's welds, which give no relpose, keep the offset
the bodies have in qpos0 (the mocap point sits 13.5 cm ahead of the gripper link, 2 cm short of
the finger tips) and are soft (solimp 0.25); ACT's waypoints then succeed on 0 of 10 seeds
(measured), and 5 of 8 at best with re-tuned heights. So the welds here hold a grasp point
GRASP_OFFSET_M ahead of the link, between the finger pads, stiffly at the mocap body, waypoints
place that point, and the left gripper goes to where the cube actually is once the right arm has
brought it to the meeting point (read from the end-effector run, as ACT reads the cube's start
pose). Command k of the trajectory is where the end-effector run stood after its tick k, so the
joint servos aim one tick ahead of the replay (ACT aims at the pose of tick k, one tick behind).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mujoco  # noqa: E402  (after .aloha, which chooses MuJoCo's GL back end)
import numpy as np
from gym_aloha.constants import ASSETS_DIR, DT, START_ARM_POSE, unnormalize_puppet_gripper_position  # noqa: E402
from gym_aloha.utils import sample_box_pose  # noqa: E402

from .aloha import SimState, TransferCube, joint_vector, step_physics

EPISODE_TICKS = 400            # ACT's episode length for transfer-cube: 8 s at 50 Hz
GRASP_OFFSET_M = 0.11          # along the gripper link's x axis; the finger pads span 0.064-0.154 m
WELD_SOLIMP = (0.95, 0.99, 0.001)
CUBE_REST_Z = 0.02             # the cube's centre resting on the table (gym-aloha drops it from 0.05)
IDENTITY = np.array([1.0, 0.0, 0.0, 0.0])
MEET_XYZ = np.array([0.0, 0.5, 0.25])    # where the right arm brings the cube
SENSE_TICK = 230               # the cube has settled at the meeting point: the left gripper goes there
RELEASE_TICK = 300             # the left gripper has closed on the cube: the right one opens


@dataclass(frozen=True)
class Waypoint:
    tick: int
    xyz: np.ndarray        # [3] grasp point, m
    quat: np.ndarray       # [4] mocap orientation (w, x, y, z)
    gripper: float         # opening: 0 closed, 1 open


def axis_angle_quat(axis, degrees: float) -> np.ndarray:
    q = np.zeros(4)
    mujoco.mju_axisAngle2Quat(q, np.asarray(axis, np.float64), np.deg2rad(degrees))
    return q


PICK_QUAT = axis_angle_quat([0, 1, 0], -60)        # right gripper pitched 60 degrees down
MEET_LEFT_QUAT = axis_angle_quat([1, 0, 0], 90)    # left gripper rolled 90 degrees: fingers close vertically


def right_waypoints(cube_xyz: np.ndarray, start: Waypoint) -> list[Waypoint]:
    """The right gripper takes the resting cube from above, brings it to the meeting point, holds
    it until the left gripper has it, lets go and moves away."""
    return [
        start,                                                                    # sleep
        Waypoint(90, cube_xyz + [0, 0, 0.08], PICK_QUAT, 1),                      # above the cube
        Waypoint(130, cube_xyz, PICK_QUAT, 1),                                    # around it
        Waypoint(170, cube_xyz, PICK_QUAT, 0),                                    # close
        Waypoint(200, MEET_XYZ + [0.05, 0, 0], PICK_QUAT, 0),                     # towards the meeting point
        Waypoint(220, MEET_XYZ, PICK_QUAT, 0),                                    # reach it
        Waypoint(RELEASE_TICK, MEET_XYZ, PICK_QUAT, 0),                           # hold
        Waypoint(RELEASE_TICK + 20, MEET_XYZ, PICK_QUAT, 1),                      # let go
        Waypoint(360, MEET_XYZ + [0.1, 0, 0], PICK_QUAT, 1),                      # move away
        Waypoint(EPISODE_TICKS, MEET_XYZ + [0.1, 0, 0], PICK_QUAT, 1),            # stay
    ]


def left_approach(start: Waypoint) -> list[Waypoint]:
    """The left gripper opens and waits beside the meeting point until SENSE_TICK."""
    wait = MEET_XYZ + [-0.12, 0, 0]
    return [start, Waypoint(100, wait, MEET_LEFT_QUAT, 1), Waypoint(EPISODE_TICKS, wait, MEET_LEFT_QUAT, 1)]


def left_handover(now: Waypoint, cube_xyz: np.ndarray) -> list[Waypoint]:
    """From where it is at now.tick, the left gripper lines up with the cube held at cube_xyz,
    moves onto it, closes, and pulls it away once the right gripper has let go."""
    away = MEET_XYZ + [-0.1, 0, 0]
    return [
        now,
        Waypoint(now.tick + 20, cube_xyz + [-0.08, 0, 0], MEET_LEFT_QUAT, 1),     # in line with the cube
        Waypoint(now.tick + 45, cube_xyz, MEET_LEFT_QUAT, 1),                     # around it
        Waypoint(RELEASE_TICK, cube_xyz, MEET_LEFT_QUAT, 0),                      # close
        Waypoint(RELEASE_TICK + 20, cube_xyz, MEET_LEFT_QUAT, 0),                 # hold while the right lets go
        Waypoint(360, away, MEET_LEFT_QUAT, 0),                                   # pull away
        Waypoint(EPISODE_TICKS, away, MEET_LEFT_QUAT, 0),                         # stay
    ]


def interpolate(waypoints: list[Waypoint], tick: int) -> Waypoint:
    """The pose and opening at `tick`: linear between the waypoints around it (MuJoCo normalises
    mocap quaternions); the last waypoint holds after its tick."""
    ticks = [w.tick for w in waypoints]
    i = int(np.searchsorted(ticks, tick, side="right")) - 1
    if i >= len(waypoints) - 1:
        return Waypoint(tick, waypoints[-1].xyz, waypoints[-1].quat, waypoints[-1].gripper)
    a, b = waypoints[i], waypoints[i + 1]
    f = (tick - a.tick) / (b.tick - a.tick)
    return Waypoint(tick, a.xyz + (b.xyz - a.xyz) * f, a.quat + (b.quat - a.quat) * f,
                    a.gripper + (b.gripper - a.gripper) * f)


class MocapTransferCube:
    """gym-aloha's end-effector (mocap) transfer-cube model, physics only, with the welds holding
    each gripper's grasp point (GRASP_OFFSET_M ahead of its link) at its mocap body."""

    def __init__(self):
        m = self.model = mujoco.MjModel.from_xml_path(
            str(ASSETS_DIR / "bimanual_viperx_end_effector_transfer_cube.xml"))
        # eq_data per weld: [0:3] the point on body2 (the gripper link), [3:6] the point on body1
        # (the mocap body), [6:10] the relative orientation (kept: MuJoCo's, from qpos0).
        m.eq_data[:, 0:3] = [GRASP_OFFSET_M, 0, 0]
        m.eq_data[:, 3:6] = 0.0
        m.eq_solimp[:, :3] = WELD_SOLIMP
        self.data = mujoco.MjData(m)
        self.substeps = round(DT / m.opt.timestep)
        self._links = [m.body(f"vx300s_{side}/gripper_link").id for side in ("left", "right")]

    def reset(self, cube_pose: np.ndarray) -> tuple[Waypoint, Waypoint]:
        """Start pose, grippers closed, the cube at cube_pose [7]; the mocap bodies where the
        grasp points are, so nothing pulls. Returns the (left, right) start waypoints."""
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        d.qpos[:16] = START_ARM_POSE
        d.qpos[16:23] = cube_pose
        mujoco.mj_forward(m, d)
        starts = []
        for i, link in enumerate(self._links):
            inverse, quat = np.zeros(4), np.zeros(4)
            mujoco.mju_negQuat(inverse, m.eq_data[i, 6:10])
            mujoco.mju_mulQuat(quat, d.xquat[link], inverse)
            d.mocap_pos[i] = d.xpos[link] + d.xmat[link].reshape(3, 3) @ [GRASP_OFFSET_M, 0, 0]
            d.mocap_quat[i] = quat
            starts.append(Waypoint(0, d.mocap_pos[i].copy(), quat, 0.0))
        d.ctrl[:] = unnormalize_puppet_gripper_position(0.0) * np.array([1, -1, 1, -1])
        mujoco.mj_forward(m, d)
        return starts[0], starts[1]

    def cube_xyz(self) -> np.ndarray:
        return self.data.qpos[16:19].copy()

    def step(self, left: Waypoint, right: Waypoint) -> np.ndarray:
        """Move the mocap bodies to the two poses and openings for one control step. Returns the
        14-D joint vector reached, with the commanded openings as the grippers."""
        d = self.data
        d.mocap_pos[:] = [left.xyz, right.xyz]
        d.mocap_quat[:] = [left.quat, right.quat]
        fingers = unnormalize_puppet_gripper_position(np.array([left.gripper, right.gripper]))
        d.ctrl[:] = [fingers[0], -fingers[0], fingers[1], -fingers[1]]
        step_physics(self.model, d, self.substeps)
        return joint_vector(d.qpos, fingers)


def expert_trajectory(seed: int, ticks: int = EPISODE_TICKS) -> np.ndarray:
    """[ticks, 14] joint-position commands of the scripted expert for the cube placement of `seed`."""
    cube_pose = sample_box_pose(seed)
    mocap = MocapTransferCube()
    left_start, right_start = mocap.reset(cube_pose)
    right = right_waypoints(np.array([*cube_pose[:2], CUBE_REST_Z]), right_start)
    left = left_approach(left_start)
    commands = []
    for k in range(ticks):
        if k == SENSE_TICK:
            left = left_handover(interpolate(left, k), mocap.cube_xyz())
        commands.append(mocap.step(interpolate(left, k), interpolate(right, k)))
    return np.stack(commands)


@dataclass
class ExpertEpisode:
    seed: int
    commands: np.ndarray           # [ticks, 14] command k held from tick k to tick k + 1
    states: list[SimState]         # [ticks + 1]: the reset, then the state after each command
    success: bool

    @property
    def first_success_tick(self) -> Optional[int]:
        return next((s.tick for s in self.states if s.success), None)


def replay(env: TransferCube, seed: int, commands: np.ndarray, on_tick=None) -> ExpertEpisode:
    """Replay commands open loop from env.reset(seed). on_tick(state, command) is called at every
    tick before its command is applied (command None after the last one): that is where a
    recorder renders and writes."""
    states = [env.reset(seed)]
    for command in commands:
        if on_tick is not None:
            on_tick(states[-1], command)
        states.append(env.step(command))
    if on_tick is not None:
        on_tick(states[-1], None)
    return ExpertEpisode(seed, commands, states, states[-1].success)


def expert_episode(env: TransferCube, seed: int, ticks: int = EPISODE_TICKS, on_tick=None) -> ExpertEpisode:
    return replay(env, seed, expert_trajectory(seed, ticks), on_tick)


