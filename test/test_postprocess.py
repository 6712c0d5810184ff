"""The official deployment's action post-processing (ros/control.PostProcess), from the values a
converted MolmoBot-DROID checkpoint records: gripper binarised, arm moves scaled as a whole."""
import dataclasses

import numpy as np

from vla_node.model.config import DROID_ROBOT, RobotConfig
from vla_node.ros.control import PostProcess

DROID = PostProcess.of(dataclasses.asdict(DROID_ROBOT))


def test_gripper_channel_is_binarised_at_the_checkpoints_threshold():
    chunk = np.zeros((3, 8))
    chunk[:, 7] = [12.0, 128.0, 128.5]     # the official rule: > 128 -> 255, else 0
    chunk[:, 0] = [0.1, 0.2, 0.3]
    out = DROID.chunk(chunk)
    assert out[:, 7].tolist() == [0.0, 0.0, 255.0]
    assert np.array_equal(out[:, :7], chunk[:, :7]) and chunk[2, 7] == 128.5   # arm untouched, input kept


def test_arm_move_is_scaled_as_a_whole_so_no_joint_exceeds_its_limit():
    measured = np.zeros(8)
    target = np.array([0.4, -0.1, 0.05, 0, 0, 0, 0, 255.0])
    out = DROID.command(target, measured)
    delta = out[:7] - measured[:7]
    assert np.abs(delta).max() == np.float64(0.2)                 # the largest move, at the limit
    np.testing.assert_allclose(delta, target[:7] / 2)             # the direction kept (scaled by 0.4 / 0.2)
    assert out[7] == 255.0                                        # the gripper is not an arm joint
    small = np.array([0.1, -0.1, 0, 0, 0, 0, 0, 0.0])
    np.testing.assert_array_equal(DROID.command(small, measured), small)   # within limits: unchanged


def test_relative_actions_add_the_measured_joints_and_scale_tightens_the_limit():
    rel = PostProcess.of(dataclasses.asdict(RobotConfig(action_type="relative", relative_dims=2,
                                                        max_joint_delta=(0.2, 0.2))), delta_scale=0.5)
    measured = np.array([1.0, -1.0, 0.3])
    out = rel.command(np.array([0.05, 0.5, 7.0]), measured)
    np.testing.assert_allclose(out, [1.0 + 0.05 * 0.2, -1.0 + 0.5 * 0.2, 7.0])   # worst joint 0.5 / 0.1 -> x0.2


def test_checkpoints_without_deployment_values_pass_actions_through():
    plain = PostProcess.of(dataclasses.asdict(RobotConfig()))
    a = np.random.default_rng(0).normal(size=(4, 8))
    row = a[0]
    assert plain.chunk(a) is a and plain.command(row, np.zeros(8)) is row
