"""gym-aloha's transfer-cube task (AlohaTransferCube-v0) on the plain MuJoCo bindings.

The model files, the start pose, the cube's seeded placement and the gripper units are
gym-aloha's own (imported from the installed package); the step and the reward repeat what its
dm_control task does, and test_sim_env.py checks them against gym-aloha's environment step for
step. We do not step gym-aloha's environment itself because its observation renders three
640x480 cameras with shadows at every step (~0.2 s here), and because dm_control (with scipy and
labmaze) is ~45 MB of wheels more for the GPU machine, which has no internet.

Units of the 14-D joint vector (observation and command alike, gym-aloha's): per arm (left
first) 6 absolute joint angles in rad (waist, shoulder, elbow, forearm_roll, wrist_angle,
wrist_rotate), then the gripper opening normalised to 0 = closed (finger at 0.01844 m) and
1 = open (0.058 m). The fingers' actuators clamp to 0.021-0.057 m, i.e. commands outside about
0.07-0.97 act as those bounds.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np


def load_llvm_users_first() -> None:
    """Triton's compiler carries its own LLVM; Mesa's software renderer (llvmpipe: EGL on a
    machine without a GPU) loads the system's. Importing triton after the first GL context
    (ours or dm_control's) crashes the process (a segfault in libtriton's initialisation, seen
    here); imported before, both work. Torch's fast engine modes import triton, so it is loaded
    (~0.2 s) with this module, before any context can exist, where it is installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        pass


load_llvm_users_first()
# MuJoCo picks its GL back end when first imported: off-screen EGL unless the user chose one.
os.environ.setdefault("MUJOCO_GL", "egl")

import mujoco  # noqa: E402
from gym_aloha.constants import (  # noqa: E402
    ASSETS_DIR,
    DT,
    JOINTS,
    START_ARM_POSE,
    normalize_puppet_gripper_position,
    unnormalize_puppet_gripper_position,
)
from gym_aloha.utils import sample_box_pose  # noqa: E402

JOINT_NAMES = tuple(JOINTS)                      # the 14 names, left arm first
CONTROL_PERIOD_NS = round(DT * 1e9)              # 20 ms: gym-aloha's 50 Hz control step
# Sim time of every reset. Not 0: ROS reads a clock at 0 as "no time yet". Each episode starts
# at the same time, so a node sees the clock jump back and forgets the last episode's inputs.
EPISODE_START_NS = 1_000_000_000
INSTRUCTION = "pick up the red cube with the right arm and hand it over to the left arm"
MAX_REWARD = 4                                   # gym-aloha: the left gripper holds the cube off the table
DEFAULT_CAMERAS = ("top", "angle")
GRIPPERS = (6, 13)                               # indices of the grippers in the 14-D vector


@dataclass(frozen=True)
class RenderConfig:
    """Which cameras are rendered, and how. `shadows` gives gym-aloha's look (shadow maps and 4x
    multisampling); off, a 240x320 frame takes ~8 ms on a CPU (Mesa llvmpipe) instead of ~65 ms."""
    cameras: tuple[str, ...] = DEFAULT_CAMERAS
    height: int = 240
    width: int = 320
    shadows: bool = False


@dataclass
class SimState:
    tick: int              # control steps since the reset
    stamp_ns: int          # sim time: EPISODE_START_NS + tick * CONTROL_PERIOD_NS
    qpos: np.ndarray       # [14] float64 joint positions in the units above
    reward: int            # gym-aloha's stage reward: 0 none, 1 touched, 2 lifted, 3 both touch, 4 handed over
    success: bool          # MAX_REWARD reached at some step since the reset


def joint_vector(qpos: np.ndarray, gripper_positions: np.ndarray) -> np.ndarray:
    """MuJoCo qpos (16 robot entries: per arm 6 joints + 2 fingers) -> the 14-D vector, with the
    gripper taken from `gripper_positions` [2] (finger positions in m, left arm first)."""
    left, right = qpos[:6], qpos[8:14]
    grippers = normalize_puppet_gripper_position(np.asarray(gripper_positions, np.float64))
    return np.concatenate([left, grippers[:1], right, grippers[1:]])


def step_physics(model, data, substeps: int) -> None:
    """One control step as dm_control steps (its legacy step): finish the step begun by the last
    mj_step1, run the rest, and end on mj_step1 so contacts and positions describe the new state
    (the reward reads the contacts)."""
    mujoco.mj_step2(model, data)
    if substeps > 1:
        mujoco.mj_step(model, data, substeps - 1)
    mujoco.mj_step1(model, data)


class Cameras:
    """Off-screen renders of a model's named cameras at one size."""

    def __init__(self, model, config: RenderConfig):
        unknown = [c for c in config.cameras if mujoco.mj_name2id(model, mujoco.mjtObj.mjOBJ_CAMERA, c) < 0]
        if unknown:
            known = [model.camera(i).name for i in range(model.ncam)]
            raise ValueError(f"unknown cameras {unknown}; the model has {known}")
        self.config = config
        model.vis.global_.offwidth = max(model.vis.global_.offwidth, config.width)
        model.vis.global_.offheight = max(model.vis.global_.offheight, config.height)
        if not config.shadows:
            model.vis.quality.offsamples = 0
        self._renderer = mujoco.Renderer(model, config.height, config.width)
        if not config.shadows:
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_SHADOW] = 0
            self._renderer.scene.flags[mujoco.mjtRndFlag.mjRND_REFLECTION] = 0

    def render(self, data, cameras: Optional[Sequence[str]] = None) -> dict[str, np.ndarray]:
        """name -> [height, width, 3] uint8 RGB (a copy)."""
        images = {}
        for name in cameras or self.config.cameras:
            self._renderer.update_scene(data, camera=name)
            images[name] = self._renderer.render().copy()
        return images

    def close(self) -> None:
        self._renderer.close()


class TransferCube:
    """The joint-space transfer-cube environment: the right arm picks the cube up and hands it to
    the left arm. reset(seed) places the cube as gym-aloha does for that seed; step(target) holds
    the 14-D joint-position target for one 20 ms control step (10 physics steps of 2 ms)."""

    def __init__(self, render: RenderConfig = RenderConfig()):
        self.model = mujoco.MjModel.from_xml_path(str(ASSETS_DIR / "bimanual_viperx_transfer_cube.xml"))
        self.data = mujoco.MjData(self.model)
        self.substeps = round(DT / self.model.opt.timestep)
        self.render_config = render
        self._cameras: Optional[Cameras] = None       # made on first render: physics alone needs no GL
        geom = lambda name: mujoco.mj_name2id(self.model, mujoco.mjtObj.mjOBJ_GEOM, name)  # noqa: E731
        box = geom("red_box")
        # gym-aloha's reward looks for these (geom1, geom2) contact pairs, in this order.
        self._pairs = {"left": (box, geom("vx300s_left/10_left_gripper_finger")),
                       "right": (box, geom("vx300s_right/10_right_gripper_finger")),
                       "table": (box, geom("table"))}
        self.state: Optional[SimState] = None
        self.seed: Optional[int] = None

    # -- episode --------------------------------------------------------------------------------
    def reset(self, seed: int) -> SimState:
        m, d = self.model, self.data
        mujoco.mj_resetData(m, d)
        d.qpos[:16] = START_ARM_POSE
        d.ctrl[:] = START_ARM_POSE
        d.qpos[-7:] = sample_box_pose(seed)
        mujoco.mj_forward(m, d)
        self.seed = seed
        self.state = SimState(0, EPISODE_START_NS, self.qpos(), self.reward(), False)
        self.state.success = self.state.reward == MAX_REWARD
        return self.state

    def step(self, target: np.ndarray) -> SimState:
        """Command the 14-D target (units above) for one control step."""
        target = np.asarray(target, np.float64)
        if target.shape != (14,) or not np.all(np.isfinite(target)):
            raise ValueError(f"the command must be 14 finite values, got shape {target.shape}")
        fingers = unnormalize_puppet_gripper_position(target[list(GRIPPERS)])
        self.data.ctrl[:] = np.concatenate([target[:6], [fingers[0], -fingers[0]],
                                            target[7:13], [fingers[1], -fingers[1]]])
        step_physics(self.model, self.data, self.substeps)
        tick = self.state.tick + 1
        reward = self.reward()
        self.state = SimState(tick, EPISODE_START_NS + tick * CONTROL_PERIOD_NS, self.qpos(), reward,
                              self.state.success or reward == MAX_REWARD)
        return self.state

    # -- what is observed -----------------------------------------------------------------------
    def qpos(self) -> np.ndarray:
        q = self.data.qpos
        return joint_vector(q, q[[6, 14]])

    def cube_pose(self) -> np.ndarray:
        """[7] the cube's position (m) and quaternion (w, x, y, z)."""
        return self.data.qpos[16:23].copy()

    def right_gripper_to_cube_m(self) -> float:
        """Distance (m) from the right gripper (the arm that picks the cube up) to the cube."""
        body = self.model.body("vx300s_right/gripper_link").id
        return float(np.linalg.norm(self.data.xpos[body] - self.data.qpos[16:19]))

    def reward(self) -> int:
        d = self.data
        contacts = set(zip(d.contact.geom1[:d.ncon].tolist(), d.contact.geom2[:d.ncon].tolist()))
        left, right, table = (self._pairs[k] in contacts for k in ("left", "right", "table"))
        if left:
            return 3 if table else 4
        if right:
            return 1 if table else 2
        return 0

    def render(self, cameras: Optional[Sequence[str]] = None) -> dict[str, np.ndarray]:
        """The configured cameras (or `cameras`) now: name -> [height, width, 3] uint8 RGB."""
        if self._cameras is None:
            self._cameras = Cameras(self.model, self.render_config)
        return self._cameras.render(self.data, cameras)

    def close(self) -> None:
        if self._cameras is not None:
            self._cameras.close()
            self._cameras = None

    def __enter__(self) -> "TransferCube":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
