"""Which frames and which state make an observation (vla_node/runtime/windows.py), on its own,
through the bag reader and through the node's frame ring, with inputs as real robots produce them:
cameras at 30 Hz with jitter and an offset between them, the gripper in its own joint state
message, stamps stepping back. No engine, no DDS."""
import numpy as np
import pytest

from vla_node.ros.frames import FrameRing, SharedInputs, Window
from vla_node.runtime import LAYOUTS, images
from vla_node.runtime.windows import (
    LATENESS_S,
    PANDA_JOINTS,
    InputError,
    JointStates,
    StampStep,
    Wait,
    WindowSpec,
    evict,
    frames_to_keep,
    pick_window,
    reorder_joints,
    window_at,
)
from vla_node.tools.bag_io import Bag, ObservationStream, resolve_inputs, stamp_ns
from vla_node.tools.sample_bag import ARM_MESSAGE_JOINTS, QuirksSpec, write_quirks_bag

MS = 1_000_000
OFFSET_S = 8 / 15       # MolmoBot-DROID: 8 steps at 15 Hz
NAMES = ("exo", "wrist")


def stamps(hz: float, seconds: float, delay_s: float = 0.0, jitter_s: float = 0.0, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    return [round((i / hz + delay_s + rng.uniform(-jitter_s, jitter_s)) * 1e9) for i in range(int(seconds * hz))]


def state_of(t_ns: int) -> tuple[np.ndarray, np.ndarray]:
    """A joint state every joint has, stamped t_ns: the picker's state callback."""
    return np.zeros(8), np.full(8, t_ns)


# -- frames ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("hz", [15.0, 30.0, 60.0])
def test_history_offset_is_a_time_whatever_the_camera_rate(hz):
    """Counted in frames, the history frame of 30 Hz cameras was 8 frames = 267 ms back, not the
    533 ms the policy was trained on."""
    spec = WindowSpec.of(2, OFFSET_S)
    exo, wrist = stamps(hz, 3.0, jitter_s=0.003, seed=1), stamps(hz, 3.0, 0.010, jitter_s=0.003, seed=2)
    offsets = []
    for n in range(int(0.6 * hz), len(exo)):
        r, rows, _ = pick_window([exo[:n], wrist[:n]], NAMES, spec, state_of)
        (old_exo, old_wrist), (new_exo, new_wrist) = rows
        offsets.append((exo[new_exo] - exo[old_exo]) / 1e9)
        assert abs(wrist[old_wrist] - exo[old_exo]) <= spec.sync_slop_ns
    assert np.abs(np.array(offsets) - OFFSET_S).max() <= 1 / hz


def test_a_camera_faster_than_the_buffer_is_sized_for_keeps_an_even_history():
    """The node's buffer holds the history span at max_camera_rate_hz; a 90 Hz camera in a buffer
    sized for 30 Hz is thinned evenly, so its history frame stays near t - offset."""
    spec = WindowSpec.of(2, OFFSET_S)
    capacity = frames_to_keep(2, OFFSET_S, 30.0)
    kept, offsets = [], []
    for t in stamps(90.0, 3.0, jitter_s=0.001):
        if len(kept) >= capacity:
            del kept[evict(kept, spec.span_ns)]
        kept.append(t)
        _, rows, _ = pick_window([kept], NAMES[:1], spec, state_of)
        if len(rows) == 2:
            offsets.append((kept[rows[1][0]] - kept[rows[0][0]]) / 1e9)
    assert len(offsets) > 150 and np.abs(np.array(offsets) - OFFSET_S).max() <= 1 / 30


def test_episode_start_sends_the_newest_frames_until_history_exists():
    """As the policy's own wrapper: no waiting for the t - offset frame; wait_for_history waits."""
    exo, wrist = stamps(30.0, 1.0), stamps(30.0, 1.0, 0.005)
    for n in (1, 5, 15):
        _, rows, _ = pick_window([exo[:n], wrist[:n]], NAMES, WindowSpec.of(2, OFFSET_S), state_of)
        assert rows == [[n - 1, n - 1]]
        wait = pick_window([exo[:n], wrist[:n]], NAMES, WindowSpec.of(2, OFFSET_S, wait_for_history=True), state_of)
        assert isinstance(wait, Wait) and wait.lacks == "history" and not wait.sync
        assert "waiting for history at t - 0.533 s" in wait.reason
    _, rows, _ = pick_window([exo[:17], wrist[:17]], NAMES, WindowSpec.of(2, OFFSET_S, wait_for_history=True),
                             state_of)
    assert rows == [[0, 0], [16, 16]]
    # Three frame times: the two newest as soon as the middle one exists.
    _, rows, _ = pick_window([exo[:20], wrist[:20]], NAMES, WindowSpec.of(3, OFFSET_S), state_of)
    assert rows == [[3, 3], [19, 19]]


def test_a_window_completes_when_the_later_camera_frame_arrives_and_never_changes():
    """The wrist camera is exposed 10 ms after the exterior one (its frames arrive later): the
    exterior frame's window waits for it instead of pairing the wrist frame 23 ms older, and once
    formed it stays the same however late it is formed (the node forms it when its plan runs low,
    the bag reader when it completes)."""
    spec = WindowSpec.of(2, OFFSET_S)
    exo, wrist = stamps(30.0, 2.0, jitter_s=0.003, seed=3), stamps(30.0, 2.0, 0.010, jitter_s=0.003, seed=4)
    for n in range(20, 50):
        r, _, _ = pick_window([exo[:n + 1], wrist[:n]], NAMES, spec, state_of)   # exo frame n arrived
        assert r == n - 1
        r, rows, _ = pick_window([exo[:n + 1], wrist[:n + 1]], NAMES, spec, state_of)   # then its wrist frame
        assert r == n and rows[-1] == [n, n]
        assert window_at([exo[:n + 30], wrist[:n + 30]], NAMES, n, spec) == rows


def test_a_camera_out_of_step_is_named():
    spec = WindowSpec.of(2, OFFSET_S)
    exo, wrist = stamps(10.0, 2.0), stamps(10.0, 2.0, 0.55)   # the wrist stamped 0.55 s late
    wait = pick_window([exo, wrist], NAMES, spec, state_of)
    assert isinstance(wait, Wait) and wait.sync
    assert wait.reason == "camera 'wrist' has no frame within sync_slop_s of camera 'exo'"
    wait = pick_window([exo, []], NAMES, spec, state_of)
    assert wait == Wait("waiting for camera 'wrist'", sync=False)


@pytest.mark.parametrize("behind_s", [0.3, 2.0])
def test_a_camera_stamped_behind_is_waited_for_only_as_long_as_a_late_frame_can_be(behind_s):
    """A camera driver stamping on its own clock, 2 s behind (found replaying such a bag): its frames
    keep arriving, so "waiting for camera 'wrist'" would never end; past LATENESS_S it is out of step."""
    spec = WindowSpec.of(2, OFFSET_S)
    exo, wrist = stamps(30.0, 3.0), stamps(30.0, 3.0, -behind_s)
    wait = pick_window([exo, wrist], NAMES, spec, state_of)
    if behind_s < LATENESS_S:       # a late frame may still come
        assert wait == Wait("waiting for camera 'wrist'", sync=False)
    else:
        assert wait == Wait("camera 'wrist' has no frame within sync_slop_s of camera 'exo', its newest is over "
                            "0.5 s older: stopped, or stamped on a clock behind", sync=True)


def test_eviction_keeps_what_a_window_needs():
    spec = WindowSpec.of(2, OFFSET_S)
    kept = stamps(30.0, 2.0)
    assert evict(kept, spec.span_ns) == 0               # older than any history time
    recent = kept[-30:]                                 # history of windows up to 0.5 s old
    assert 0 < evict(recent, spec.span_ns) < 28         # all needed: thin, keep both ends


# -- joints ---------------------------------------------------------------------------------------
def test_reorder_joints_takes_the_wanted_joints_by_name():
    index, values = reorder_joints(["b", "x", "a"], [2.0, float("nan"), 1.0], ["a", "b", "c"])
    assert index.tolist() == [1, 0] and values.tolist() == [2.0, 1.0]     # x (not wanted) may be anything
    with pytest.raises(InputError, match="2 names but 1 positions"):
        reorder_joints(["a", "b"], [1.0], ["a"])
    with pytest.raises(InputError, match=r"non-finite joint positions for \['b'\]"):
        reorder_joints(["a", "b"], [1.0, float("inf")], ["a", "b"])
    with pytest.raises(InputError, match=r"names \['a'\] more than once"):
        reorder_joints(["a", "b", "a", "x", "x"], [1.0, 2.0, 3.0, 4.0, 5.0], ["a", "b"])


def test_split_arm_and_gripper_messages_give_the_state_written():
    """The arm driver and the gripper driver each publish on /joint_states (shuffled, with finger
    joints the model does not use): each joint's sample nearest the frame."""
    joints = JointStates(PANDA_JOINTS)
    arm = {name: float(i) for i, name in enumerate(ARM_MESSAGE_JOINTS)}
    for k in range(100):                         # arm at 100 Hz, gripper at 30 Hz, 3 ms later
        t = k * 10 * MS
        assert joints.add(t, list(arm), [v + k for v in arm.values()]) == 7
        if k % 3 == 0:
            assert joints.add(t + 3 * MS, ["panda_gripper"], [0.5 + k]) == 1
    positions, at = joints.at(500 * MS + 4 * MS, 50 * MS)
    expected = [arm[f"panda_joint{i}"] + 50 for i in range(1, 8)] + [0.5 + 51]
    np.testing.assert_array_equal(positions, expected)
    assert at.tolist() == [500 * MS] * 7 + [513 * MS]


def test_a_joint_sample_is_taken_once_a_later_one_exists():
    joints = JointStates(["a", "b"])
    joints.add(0, ["a", "b"], [0.0, 0.0])
    joints.add(10 * MS, ["a"], [1.0])
    wait = joints.at(8 * MS, 50 * MS)      # b's next sample may be nearer than its sample at 0
    assert wait == Wait("waiting for a joint state for ['b'] stamped after the frames", sync=False, lacks="state")
    joints.add(20 * MS, ["b"], [2.0])
    positions, at = joints.at(8 * MS, 50 * MS)
    assert positions.tolist() == [1.0, 0.0] and at.tolist() == [10 * MS, 0]


def test_a_joint_never_heard_from_holds_with_its_name():
    joints = JointStates(PANDA_JOINTS)
    joints.add(0, PANDA_JOINTS[:7], np.zeros(7))
    assert joints.add(0, ["ur_joint1"], [0.0]) == 0     # another part's driver: not an error
    wait = joints.at(0, 50 * MS)
    assert wait.reason == "no joint state for ['panda_gripper'] yet (the latest message named only ['ur_joint1'])"
    assert joints.newest() is None


def test_joint_states_on_another_clock_are_out_of_step():
    joints = JointStates(["a"])
    for k in range(10):
        joints.add(k * 10 * MS, ["a"], [0.0])
    wait = joints.at(2_000 * MS, 50 * MS)
    assert wait.sync and wait.reason == (
        "no joint state stamped within state_slop_s (50 ms) of the frames and none after them yet: stopped, or "
        "stamped on another clock than the cameras? (state_sync newest ignores stamps)")
    assert "the earliest is after them" in joints.at(-1_000 * MS, 50 * MS).reason


def test_a_gap_in_one_joints_messages_is_named_as_a_gap_not_a_clock():
    """A gripper driver silent for 0.6 s (found replaying such a bag): the frames in the gap get no
    state; the hold says the gap, not that the clocks differ."""
    joints = JointStates(PANDA_JOINTS)
    for k in range(100):
        joints.add(k * 10 * MS, PANDA_JOINTS[:7], np.zeros(7))
    for t in (0, 50, 100, 700, 750):
        joints.add(t * MS, ["panda_gripper"], [0.01])
    assert joints.at(400 * MS, 50 * MS) == Wait(
        "no joint state for ['panda_gripper'] stamped within state_slop_s (50 ms) of the frames: a gap in the "
        "messages around them", sync=True, lacks="state")
    joints = JointStates(PANDA_JOINTS)
    joints.add(0, PANDA_JOINTS, np.zeros(8))
    joints.add(400 * MS, PANDA_JOINTS[:7], np.zeros(7))
    assert "for ['panda_gripper'] stamped within state_slop_s (50 ms) of the frames and none after them yet: " \
        "stopped" in joints.at(400 * MS, 50 * MS).reason


def test_a_slow_joint_is_waited_for_and_one_slower_than_the_slop_allows_says_so():
    """A 10 Hz gripper driver: a frame 70 ms after its newest sample waits for the next one (due
    in 30 ms), it was said to have stopped; samples 120 ms apart leave frames between them with
    none within 50 ms: raise state_slop_s."""
    joints = JointStates(["gripper"])
    for t in range(0, 1001, 100):
        joints.add(t * MS, ["gripper"], [0.0])
    assert joints.at(1070 * MS, 50 * MS) == Wait("waiting for a joint state stamped after the frames", sync=False,
                                                 lacks="state")
    assert "none after them yet: stopped" in joints.at(1160 * MS, 50 * MS).reason
    joints = JointStates(["gripper"])
    for t in range(0, 1201, 120):
        joints.add(t * MS, ["gripper"], [0.0])
    assert joints.at(1140 * MS, 50 * MS).reason == (
        "no joint state stamped within state_slop_s (50 ms) of the frames: its messages come more than twice "
        "state_slop_s apart (raise state_slop_s)")
    positions, at = joints.at(1135 * MS, 60 * MS)
    assert at.tolist() == [1080 * MS]


def test_a_joint_stamp_stepping_back_keeps_nothing_of_the_message():
    joints = JointStates(["a", "b"])
    joints.add(1000 * MS, ["a", "b"], [1.0, 1.0])
    joints.add(1000 * MS, ["a"], [2.0])            # the same stamp again: the later message wins
    with pytest.raises(StampStep, match=r"joint_states \(b\) stamps stepped back by 1.000 s"):
        joints.add(0, ["b", "a"], [3.0, 3.0])
    assert joints.newest().tolist() == [2.0, 1.0]


# -- the bag reader and the node's frame ring -----------------------------------------------------
def truth(path):
    """(camera or joint, stamp) -> the recorder's log time of the message, for every frame and
    joint sample of a bag; and the joints' positions by (joint, stamp)."""
    log, positions = {}, {}
    with Bag(path) as bag:
        for topic, msgtype, time_ns, raw in bag.messages([t for t in bag.topics if t not in ("/clock",
                                                                                             "/instruction")]):
            msg = bag.deserialize(raw, msgtype, topic)
            stamp = stamp_ns(msg.header.stamp)
            keys = [(name, stamp) for name in msg.name] if hasattr(msg, "name") else [(topic.split("/")[2], stamp)]
            for i, key in enumerate(keys):
                assert key not in log, f"{key} twice: the test needs unique stamps"
                log[key] = time_ns
                if hasattr(msg, "name"):
                    positions[key] = msg.position[i]
    return log, positions


def offline_queries(path, **options):
    layout = LAYOUTS["droid"]
    with Bag(path) as bag:
        stream = ObservationStream(bag, resolve_inputs(bag, layout.cameras), layout, OFFSET_S, **options)
        return list(stream), stream.stats


@pytest.fixture(scope="module")
def quirks(tmp_path_factory):
    """The shipped quirky bag's recipe, stamps stepping back 2 s at 4.2 s."""
    path = write_quirks_bag(tmp_path_factory.mktemp("quirks") / "quirks.mcap")
    return path, *offline_queries(path), *truth(path)


def test_bag_reader_assembles_split_shuffled_joint_states_by_name(quirks):
    """Offline replay used to need --joint-names for a message with extra joints, and fed an
    8-joint message in another order to the model misordered."""
    _, frames, _, _, positions = quirks
    assert len(frames) > 120
    for frame in frames:
        written = [positions[name, int(t)] for name, t in zip(PANDA_JOINTS, frame.state_stamps_ns)]
        np.testing.assert_array_equal(frame.observation.state, np.float32(written))
        assert np.abs(frame.state_stamps_ns - frame.stamp_ns).max() <= 10 * MS


def test_bag_reader_queries_every_frame_of_cameras_10ms_apart(quirks):
    """It formed a query only when the first camera's frame arrived: with the second camera 10 ms
    later it dropped most frames as out of sync."""
    _, frames, stats, _, _ = quirks
    spec = QuirksSpec()
    dropout_frames = (spec.dropout_s[1] - spec.dropout_s[0]) * spec.camera_hz
    assert stats.first_camera_frames == spec.duration_s * spec.camera_hz
    assert stats.frames_without_sync <= dropout_frames + 1
    assert len(frames) >= stats.first_camera_frames - dropout_frames - 2
    for frame in frames:
        exo, wrist = frame.observation.frame_ids[-2:]
        assert 0 < wrist[1] - exo[1] <= 20 * MS      # the wrist frame exposed with it, 10 ms later


@pytest.mark.parametrize("back_s", [1.0, 2.0])
def test_stamps_stepping_back_never_mix_timelines(tmp_path, back_s):
    """A recorded simulation reset: every source's stamps step back. No query holds frames or
    joint samples from both sides of the step (offline replay mixed them in 26 of 40 queries),
    and queries resume on the new timeline."""
    spec = QuirksSpec(duration_s=4.0, dropout_s=(0.0, 0.0), steps=((2.5, back_s),))
    path = write_quirks_bag(tmp_path / "reset.mcap", spec)
    frames, stats = offline_queries(path)
    log, _ = truth(path)
    step_log_ns = frames[0].log_time_ns - frames[0].log_time_ns % 10**9 + int(2.5e9)   # START_NS is whole seconds
    sides = []
    for frame in frames:
        keys = list(frame.observation.frame_ids) + list(zip(PANDA_JOINTS, frame.state_stamps_ns.tolist()))
        after = {log[key] >= step_log_ns for key in keys}
        assert len(after) == 1, f"query {frame.index} mixes the timelines: {keys}"
        sides.append(after.pop())
    assert stats.timeline_restarts >= 1   # a source's old-timeline message can follow another's step
    assert sides.count(False) > 40 and sides.count(True) > 30


def node_windows(path, seed=0):
    """Windows of the node's frame ring and joint assembler, fed the bag's messages in recorded
    order and asked for a window at arbitrary moments (when the plan runs low, while no camera is
    stale), each pinned until a later message (inference in flight), with the node's reaction to
    stamps stepping back: [(window, its pixels)]."""
    layout = LAYOUTS["droid"]
    spec = WindowSpec.of(layout.frames, OFFSET_S)
    keep = frames_to_keep(layout.frames, OFFSET_S, 30.0)
    shared = SharedInputs(list(layout.cameras), PANDA_JOINTS, 120, 160, spec, keep,
                          bytearray(int(np.prod(FrameRing.shape_of(2, 120, 160, keep, layout.frames)))))
    rng = np.random.default_rng(seed)
    windows, in_flight = [], []
    with Bag(path) as bag:
        inputs = resolve_inputs(bag, layout.cameras)
        cameras = {c.topic: i for i, c in enumerate(inputs.cameras)}
        for topic, msgtype, time_ns, raw in bag.messages([c.topic for c in inputs.cameras] + [inputs.joint_states]):
            msg = bag.deserialize(raw, msgtype, topic)
            stamp = stamp_ns(msg.header.stamp)
            fill = images.compressed_into if hasattr(msg, "format") else images.image_into
            if topic in cameras:    # a timeline change forgets the old timeline's inputs, this one kept
                shared.write(cameras[topic], stamp, time_ns, lambda out: fill(msg, out))
            elif topic == inputs.joint_states:
                shared.add_joint_states(stamp, msg.name, msg.position, time_ns)
            if in_flight and rng.random() < 0.3:   # its result: the engine read the pixels now
                window = in_flight.pop()
                windows.append((window, [shared.ring.pixels[s].copy() for s in window.slots]))
                shared.unpin()
            fresh = all(r is not None and time_ns - r <= 0.5e9 for r in shared.newest_received_ns())
            if topic in cameras and fresh and not in_flight and rng.random() < 0.3:
                window = shared.take_window()
                if isinstance(window, Window):
                    in_flight.append(window)
                else:
                    shared.unpin()
    return windows


def test_the_node_frame_ring_forms_the_windows_the_bag_reader_forms(quirks):
    """One picker: the node's frame buffer and joint assembler give the same frames (pixels too)
    and joint samples as the bag reader's query for the same newest frame."""
    path, frames, _, _, _ = quirks
    assert_node_windows_are_queries(path, frames)


def test_a_camera_faster_than_the_buffer_gives_up_the_frames_the_bag_reader_does(tmp_path):
    """60 Hz cameras in a buffer sized for 30 Hz: history is thinned by stamps alone, so a window
    pinned while frames arrive does not change which frames are kept (it changed 4 of 50 history
    frames of a live replay when the node gave up another frame instead of a pinned one)."""
    path = write_quirks_bag(tmp_path / "fast.mcap", QuirksSpec(duration_s=4.0, camera_hz=60.0, steps=()))
    frames, _ = offline_queries(path)
    assert_node_windows_are_queries(path, frames)


def assert_node_windows_are_queries(path, frames):
    offline = {f.stamp_ns: f for f in frames}
    windows = node_windows(path)
    assert len(windows) > 30
    for window, pixels in windows:
        query = offline[window.stamp_ns]
        assert window.frame_ids == query.observation.frame_ids
        assert window.state_stamps_ns.tolist() == query.state_stamps_ns.tolist()
        np.testing.assert_array_equal(window.state.astype(np.float32), query.observation.state)
        for got, want in zip(pixels, query.observation.images):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("back_s", [1.0, 2.0])
def test_the_node_frame_ring_never_mixes_timelines(tmp_path, back_s):
    spec = QuirksSpec(duration_s=4.0, dropout_s=(0.0, 0.0), steps=((2.5, back_s),))
    path = write_quirks_bag(tmp_path / "reset.mcap", spec)
    log, _ = truth(path)
    windows = node_windows(path, seed=1)
    step_log_ns = min(log.values()) - min(log.values()) % 10**9 + int(2.5e9)
    sides = []
    for window, _ in windows:
        keys = list(window.frame_ids) + list(zip(PANDA_JOINTS, window.state_stamps_ns.tolist()))
        after = {log[key] >= step_log_ns for key in keys}
        assert len(after) == 1, f"a window mixes the timelines: {keys}"
        sides.append(after.pop())
    assert sides.count(False) > 15 and sides.count(True) > 10
