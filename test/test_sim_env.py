"""The simulated task: our transfer-cube steps exactly as gym-aloha's, the scripted expert hands
the cube over, and a recorded episode reads back through bag_io as the node would see it."""
import numpy as np
import pytest

from optional import require_simulator

require_simulator()

from vla_node.runtime import WindowLayout  # noqa: E402
from vla_node.sim.aloha import (  # noqa: E402
    CONTROL_PERIOD_NS,
    EPISODE_START_NS,
    INSTRUCTION,
    JOINT_NAMES,
    MAX_REWARD,
    RenderConfig,
    TransferCube,
)
from vla_node.sim.expert import expert_episode, expert_trajectory  # noqa: E402
from vla_node.sim.record import RecordConfig, camera_topic, record_episode  # noqa: E402
from vla_node.tools.bag_io import (  # noqa: E402
    COMPRESSED_IMAGE,
    DEMO_COMMAND_TOPIC,
    INSTRUCTION_TOPIC,
    JOINT_STATE,
    JOINT_STATES_TOPIC,
    JOINT_TRAJECTORY,
    REFERENCE_TOPIC,
    STRING,
    Bag,
    ObservationStream,
    resolve_inputs,
    stamp_ns,
    trajectory_positions,
)


@pytest.fixture(scope="module")
def env():
    with TransferCube(RenderConfig(cameras=("top", "angle"), height=48, width=64)) as sim:
        yield sim


def gym_aloha_env(seed):
    """gym-aloha's own environment (dm_control), reset for `seed`, with its per-step rendering of
    three 640x480 cameras skipped (0.2 s a step; the physics is what is compared)."""
    gym_aloha_env_module = pytest.importorskip("gym_aloha.env")
    from gym_aloha.tasks.sim import TransferCubeTask
    env = gym_aloha_env_module.AlohaEnv(task="transfer_cube")
    env.reset(seed=seed)
    task = env._env.task
    task.get_observation = lambda physics: {"qpos": TransferCubeTask.get_qpos(physics)}
    return env._env


@pytest.mark.parametrize("seed", [0, 7])
def test_steps_and_rewards_equal_gym_aloha_along_the_expert_trajectory(env, seed):
    reference = gym_aloha_env(seed)
    commands = expert_trajectory(seed)
    state = env.reset(seed)
    assert np.array_equal(state.qpos, reference.task.get_qpos(reference.physics))
    rewards = []
    for command in commands:
        step = reference.step(command)
        state = env.step(command)
        np.testing.assert_array_equal(state.qpos, step.observation["qpos"])
        assert state.reward == step.reward
        rewards.append(state.reward)
    assert MAX_REWARD in rewards   # the comparison covered a hand-over, not just an idle arm


def test_scripted_expert_hands_the_cube_over(env):
    for seed in (0, 1, 2):
        episode = expert_episode(env, seed)
        assert episode.success, f"seed {seed}: rewards {sorted({s.reward for s in episode.states})}"
        assert episode.states[0].reward == 0 and not episode.states[0].success


def test_commands_are_absolute_joint_positions_and_gripper_openings(env):
    start = env.reset(3)
    for _ in range(50):
        held = env.step(start.qpos)
    np.testing.assert_allclose(held.qpos[:6], start.qpos[:6], atol=0.02)   # rad: the arm holds still
    target = start.qpos.copy()
    target[7] += 0.3                 # right waist, rad
    target[13] = 1.0                 # right gripper fully open
    for _ in range(100):
        moved = env.step(target)
    assert abs(moved.qpos[7] - target[7]) < 0.02
    assert moved.qpos[13] > 0.9      # the opening reads back in the command's units
    with pytest.raises(ValueError, match="14 finite values"):
        env.step(np.full(14, np.nan))


def test_cameras_render_by_name_at_the_configured_size(env):
    env.reset(0)
    images = env.render()
    assert list(images) == ["top", "angle"]
    assert all(i.shape == (48, 64, 3) and i.dtype == np.uint8 for i in images.values())
    red = images["top"].astype(int)
    assert ((red[..., 0] > 150) & (red[..., 1] < 80)).any()   # the red cube is in view
    with pytest.raises(ValueError, match="unknown cameras"):
        TransferCube(RenderConfig(cameras=("nope",))).render()


def test_recorded_episode_reads_back_as_the_node_sees_it(env, tmp_path):
    config = RecordConfig(render=env.render_config, camera_every=2, ticks=24, reference_horizon=4)
    record = record_episode(env, 5, tmp_path / "episode.mcap", config)
    commands = expert_trajectory(5, 24)
    assert record.bytes == (tmp_path / "episode.mcap").stat().st_size
    with Bag(tmp_path / "episode.mcap") as bag:
        cameras = [camera_topic(c) + "/compressed" for c in ("top", "angle")]
        assert bag.topics == {INSTRUCTION_TOPIC: STRING, JOINT_STATES_TOPIC: JOINT_STATE,
                              DEMO_COMMAND_TOPIC: JOINT_STATE, REFERENCE_TOPIC: JOINT_TRAJECTORY,
                              **{t: COMPRESSED_IMAGE for t in cameras}}
        read = {t: [bag.deserialize(raw, msgtype, t) for _, msgtype, _, raw in bag.messages([t])] for t in bag.topics}
        assert [m.data for m in read[INSTRUCTION_TOPIC]] == [INSTRUCTION]
        ticks = np.arange(25)
        states = read[JOINT_STATES_TOPIC]
        assert [stamp_ns(m.header.stamp) for m in states] == list(EPISODE_START_NS + ticks * CONTROL_PERIOD_NS)
        assert all(list(m.name) == list(JOINT_NAMES) for m in states)
        sent = read[DEMO_COMMAND_TOPIC]
        assert [stamp_ns(m.header.stamp) for m in sent] == list(EPISODE_START_NS + ticks[:24] * CONTROL_PERIOD_NS)
        np.testing.assert_array_equal(np.stack([m.position for m in sent]), commands)
        for camera in cameras:
            stamps = [stamp_ns(m.header.stamp) for m in read[camera]]
            assert stamps == list(EPISODE_START_NS + ticks[::2] * CONTROL_PERIOD_NS)
        first_reference = read[REFERENCE_TOPIC][0]
        np.testing.assert_allclose(trajectory_positions(first_reference), commands[:4], rtol=1e-6)

        layout = WindowLayout(("top", "angle"), frames=2)
        stream = ObservationStream(bag, resolve_inputs(bag, layout.cameras, [camera_topic(c) for c in layout.cameras]),
                                   layout, history_offset_s=6 * CONTROL_PERIOD_NS / 1e9, joint_names=JOINT_NAMES,
                                   wait_for_history=True)
        frames = list(stream)
    # 13 frames of the first camera (every 2 ticks), the first 3 without their history frame 6 ticks back.
    assert len(frames) == 10 and stream.stats.frames_without_history == 3
    replayed = expert_episode(env, 5, ticks=24)
    for frame in frames:
        tick = (frame.stamp_ns - EPISODE_START_NS) // CONTROL_PERIOD_NS
        # Both cameras of a slot come from one tick (the first camera's frame is written last),
        # and the state is the joint state of that tick.
        assert [ns for _, ns in frame.observation.frame_ids] == [frame.stamp_ns - 6 * CONTROL_PERIOD_NS] * 2 + \
            [frame.stamp_ns] * 2
        np.testing.assert_allclose(frame.observation.state, replayed.states[tick].qpos, rtol=1e-6)
        assert frame.observation.instruction == INSTRUCTION
