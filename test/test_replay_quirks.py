"""The shipped quirky bag (vla_node/data/sample_quirks.mcap: 30 Hz jpeg + bgr8 cameras 10 ms apart
with stamp jitter, a 0.8 s wrist dropout, arm and gripper in separate joint state messages with
shuffled and extra joints, an instruction change, every stamp and /clock stepping back 2 s) replayed
live into a real node (`vla-node` process, DDS in between), with the node logging every observation
it sends (--log-level debug), and compared with offline replay of the same bag."""
import numpy as np
import pytest

from ros_helpers import chunk_period_ticks, chunks_answered, jump_back_fits
from vla_node.ros.diagnostics import LOG_BURST, LOG_WINDOW_S
from vla_node.ros.params import SPECS
from vla_node.runtime import LAYOUTS
from vla_node.runtime.windows import PANDA_JOINTS
from vla_node.tools.bag_io import Bag, ObservationStream, resolve_inputs, stamp_ns
from vla_node.tools.demo import NodeProcess, tiny_config
from vla_node.tools.live import LiveOptions, logged_observations, replay_live
from vla_node.tools.sample_bag import QUIRKS_BAG, START_NS, QuirksSpec

SPEC = QuirksSpec()           # the recipe of the shipped bag
STEP_S, BACK_S = SPEC.steps[0]
SMALL = {"camera_height": SPEC.size[0], "camera_width": SPEC.size[1]}
INPUT_TIMEOUT_S = SPECS["input_timeout_s"].default   # config/tiny.yaml keeps it: older inputs hold the arm


@pytest.fixture(scope="module")
def truth():
    """(camera or joint, stamp) -> log time (recording time) of every frame and joint sample of
    the bag, each joint sample's position, and each joint's first (stamp, position)."""
    log, positions = {}, {}
    with Bag(QUIRKS_BAG) as bag:
        for topic, msgtype, time_ns, raw in bag.messages(["/joint_states", "/cameras/exo/image_raw/compressed",
                                                          "/cameras/wrist/image_raw"]):
            msg = bag.deserialize(raw, msgtype, topic)
            stamp = stamp_ns(msg.header.stamp)
            if topic == "/joint_states":
                for name, position in zip(msg.name, msg.position):
                    log[name, stamp], positions[name, stamp] = time_ns, position
            else:
                log[topic.split("/")[2], stamp] = time_ns
    first = {name: min((t, x) for (n, t), x in positions.items() if n == name) for name in PANDA_JOINTS}
    return log, positions, first


def prerolled(first, name: str, stamp: int) -> bool:
    """Whether a joint sample the node used is the player's pre-roll: the bag's first joint states,
    published until the node hears them, stamped as they were sent, so before the bag's first one
    (the node may still hold it when its first query comes, if the bag's own sample is late)."""
    return stamp < first[name][0]


@pytest.fixture(scope="module")
def offline():
    """Offline replay's queries by the stamp of their newest frame."""
    layout = LAYOUTS["droid"]
    with Bag(QUIRKS_BAG) as bag:
        return {f.stamp_ns: f for f in ObservationStream(bag, resolve_inputs(bag, layout.cameras), layout, 8 / 15)}


@pytest.fixture(scope="module")
def wall_clock(tmp_path_factory, offline):
    """The bag replayed into a node on the wall clock (header stamps shifted to playback time),
    and the observations the node logged, shifted back onto the bag's stamps."""
    out = tmp_path_factory.mktemp("quirks_live")
    with NodeProcess(tiny_config(), out / "node.log", SMALL, ("--log-level", "vla_node:=debug")) as node:
        live = replay_live(LiveOptions(bag=QUIRKS_BAG, out=out / "live", wait_s=120.0, abort_if=node.exited),
                           progress=lambda m: None)
    text = (out / "node.log").read_text()
    observations, hits = logged_observations(text, offline)
    return live, text, observations, hits


def test_the_node_sends_what_offline_replay_sends(wall_clock, offline, truth):
    """Same frame stamps and same state for every query both make; the state assembled from the
    arm's and the gripper's separate messages is the one written to the bag."""
    live, _, observations, hits = wall_clock
    log, positions, first = truth
    # One per replan_threshold ticks (160 ms) while inputs are good, one per inference where that
    # is slower (a busy machine): over 25 at 8 ticks.
    assert len(observations) > 25 * 8 // chunk_period_ticks(live)
    assert hits >= len(observations) // 2
    compared = early = 0
    for frames, state, stamps in observations:
        early_joints = [prerolled(first, name, int(t)) for name, t in zip(PANDA_JOINTS, stamps)]
        written = [first[name][1] if early_joint else positions[name, int(t)]
                   for name, t, early_joint in zip(PANDA_JOINTS, stamps, early_joints)]
        np.testing.assert_array_equal(state, written)
        if any(early_joints):   # offline replay has no pre-roll: nothing to compare with
            early += 1
            continue
        query = offline.get(frames[-2][1])
        if query is None:
            continue
        if len(frames) < len(query.observation.frame_ids):
            # The node never had the history frame (lost on the way, or dropped unconverted on a
            # saturated machine): it sent the episode-start window, as it must without one.
            continue
        # Where the node never had a frame or joint sample offline replay took, or had not yet taken
        # it in when it sent the query (lost on the way, dropped unconverted or still queued on a busy
        # machine: one period and a half off beside three busy loops, three arm and two gripper periods
        # behind in a clean-clone CI run of the suite in two processes), it sends the nearest it had,
        # within input_timeout_s (older inputs hold the arm): not compared, like a missing history frame.
        ids = query.observation.frame_ids
        assert [c for c, _ in frames] == [c for c, _ in ids], (frames, ids)
        apart_ns = np.array([t for _, t in frames]) - np.array([t for _, t in ids])
        ahead_ns = stamps - query.state_stamps_ns
        for what, off_ns in (("frames", apart_ns), ("joints' samples", ahead_ns)):
            assert (np.abs(off_ns) < INPUT_TIMEOUT_S * 1e9).all(), f"{what} {off_ns.tolist()} ns after offline's"
        if apart_ns.any() or ahead_ns.any():
            continue
        compared += 1
    assert early <= 2, f"{early} observations with the player's pre-roll joint states: only the first may have them"
    assert compared >= len(observations) * 0.8, f"{compared} of {len(observations)} observations offline made too"


def test_the_node_never_mixes_timelines(wall_clock, truth):
    """Every frame and joint sample of an observation was recorded on one side of the step back."""
    live, text, observations, hits = wall_clock
    log, _, first = truth
    assert hits >= len(observations) // 2
    step_ns = START_NS + int(STEP_S * 1e9)
    sides = []
    for frames, _, stamps in observations:
        # the player's pre-roll joint states are the bag's first ones: before the step back
        keys = frames + [key for key in zip(PANDA_JOINTS, stamps.tolist()) if not prerolled(first, *key)]
        after = {log[key] >= step_ns for key in keys}
        assert len(after) == 1, f"an observation mixes the timelines: {keys}"
        sides.append(after.pop())
    fewer = 8 / chunk_period_ticks(live)     # observations at the node's inference latency, as above
    assert sides.count(False) > 20 * fewer and sides.count(True) > 10 * fewer
    assert "holding: timeline: " in text and "resolved: timeline: " in text
    assert live["holds"]["by_cause"].get("timeline", 0) >= 1


def test_holds_name_their_cause_and_diagnostics_keep_their_rate(wall_clock):
    """During the wrist camera's dropout the node holds for the camera (it used to blame
    inference), and /diagnostics stays near 1 Hz (the split joint states made it ~100 Hz)."""
    live, text, _, _ = wall_clock
    dropout = [c["status"] for c in live["holds"]["changes"] if SPEC.dropout_s[0] < c["t_s"] < SPEC.dropout_s[1] + 0.3]
    assert any("camera 'wrist'" in status for status in dropout), dropout
    assert not any("inference" in status for status in dropout), dropout
    with Bag(live["recording"]) as recording:
        sent = sum(1 for _ in recording.messages(["/diagnostics"]))
    # Near 1 Hz: each hold that starts or ends is published at once too, at most LOG_BURST times
    # per source and LOG_WINDOW_S (on a busy machine holds come and go more often); ~100 Hz, as
    # before joint states were assembled by name, would be hundreds.
    seconds = SPEC.duration_s + 2
    sources = len(live["holds"]["by_cause"])
    assert sent <= seconds + 1 + LOG_BURST * sources * (1 + seconds // LOG_WINDOW_S), \
        f"{sent} /diagnostics messages, {sources} hold sources"
    assert chunks_answered(live) > 10 * 8 // chunk_period_ticks(live) and "lacks joints" not in text


def test_live_replay_plays_the_bags_clock_into_a_sim_time_node(tmp_path):
    """`vla-replay live` plays the bag's own /clock to a node on use_sim_time, so a recorded
    simulation reset is replayed: the node's clock jumps back, it holds, says so, and resumes."""
    with NodeProcess(tiny_config(), tmp_path / "node.log", {"use_sim_time": True, **SMALL}) as node:
        live = replay_live(LiveOptions(bag=QUIRKS_BAG, out=tmp_path / "live", wait_s=120.0, abort_if=node.exited),
                           progress=lambda m: None)
    assert live["clock"] and live["published"]["/clock"] == SPEC.duration_s * SPEC.clock_hz
    statuses = [c["status"] for c in live["holds"]["changes"]]
    assert any(jump_back_fits(status, BACK_S, 1 / SPEC.clock_hz) for status in statuses), statuses
    with Bag(live["recording"]) as recording:
        stamps = [(t, stamp_ns(recording.deserialize(raw, msgtype).header.stamp))
                  for _, msgtype, t, raw in recording.messages(["/vla_node/joint_trajectory"])]
    reset_ns = START_NS + int(STEP_S * 1e9)
    # Trajectories are stamped on the bag's clock: before the reset up to it, after it back 2 s.
    assert all(START_NS <= stamp <= reset_ns + 10**9 for _, stamp in stamps)
    assert any(t > reset_ns + 10**8 and stamp < reset_ns - 10**9 for t, stamp in stamps)
