"""`vla-replay live` and the demo against the real node (a `vla-node` process, DDS in between).

The demo runs once for the module: it starts the node with config/tiny.yaml, replays the shipped
bag into it live and compares two engine configurations offline; the tests check what it did.
Every ROS participant of this module lives in a ROS domain of its own (conftest.py).
"""
import time

import numpy as np
import pytest

from ros_helpers import chunk_period_ticks, chunks_answered
from vla_node.tools.bag_io import (
    COMPRESSED_IMAGE,
    IMAGE,
    TYPESTORE,
    Bag,
    BagError,
    compressed_image_msg,
    decode_image,
    image_msg,
)
from vla_node.tools.demo import NodeProcess, run_demo, tiny_config
from vla_node.tools.live import LiveError, LiveOptions, Route, convert, replay_live
from vla_node.tools.sample_bag import SAMPLE_BAG, SampleSpec, write_sample_bag


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "demo"
    lines = []
    result = run_demo(out, print_fn=lines.append)
    return result, "\n".join(lines), out


def test_live_replay_yields_the_expected_chunks_at_the_configured_rate(demo):
    result, _, _ = demo
    live = result.live
    with Bag(SAMPLE_BAG) as bag:
        cameras = sum(1 for _ in bag.messages(["/cameras/exo/image_raw/compressed"]))
        joint_states = sum(1 for _ in bag.messages(["/joint_states"]))
    assert live["published"] == {"/cameras/exo/image_raw": cameras, "/cameras/wrist/image_raw": cameras,
                                 "/joint_states": joint_states, "/instruction": 1}
    assert live["bag_damage"] is None and not live["clock"]
    # One chunk per replan_threshold (8) ticks at 50 Hz from the first chunk until the inputs go
    # stale: ~37 over the 6 s bag, while inference is faster than 8 ticks (fewer where the first
    # chunk comes late: 13 in a clean-clone CI run on a loaded 2-core VM, whose first answers came
    # too late to use). Where inference is slower (a busy machine), one per inference: the node's own
    # slowest request -> chunk time says how many at least (chunks that came too late to use
    # included). Never more than one per 8 ticks: inputs taken in late (queued in the node) may keep
    # it running a chunk or two longer.
    expected = live["expected_chunks"]
    assert expected is not None and expected >= 1, live
    slack = max(2, expected // 10)
    assert live["chunks"] <= expected + slack
    assert chunks_answered(live) >= expected * 8 // chunk_period_ticks(live) - slack, live
    assert_commands_at_50_hz(live)
    assert live["latency_ms"]["total"]["p50"] > 0
    # The node heard the bag from its first frame: as the policy's own wrapper it does not wait for
    # the t-8 history frame (the 9th exterior frame, 0.55 s). Its first chunk came 16 - n ticks
    # after its request (n: the actions left of it), so it asked after the first frame (22 ms) and
    # before the history frame existed, however long the inference took. Where the node dropped
    # chunks that came too late to execute (a loaded machine), the first one recorded answers a
    # later request: the recording cannot say when the first was made.
    if live["node_late_chunks"]:
        return
    with Bag(live["recording"]) as recording:
        _, msgtype, _, raw = next(recording.messages(["/vla_node/joint_trajectory"]))
        left = len(recording.deserialize(raw, msgtype).points)
    requested_s = live["first_chunk_s"] - (16 - left) * 0.02
    assert 0.0 < requested_s < 0.55, (live["first_chunk_s"], left)


def assert_commands_at_50_hz(live: dict) -> None:
    """A live replay's node on the wall clock commanded at its 50 Hz: its median tick within half a
    period of its due time by its own measure (so in its own period's slot; how close a busy
    machine keeps it is the benchmarks' to say: beside three busy loops and more, 2.7 ms), and one
    command a tick as the recorder received them: the median gap between two is the period (a
    second publisher or a doubled tick halves it). Not the count over the recording's span: on a
    busy machine the recorder may receive the first commands late and together, which shortens a
    one-second span by more than any fixed tolerance (57.6 Hz measured once for a node at 50)."""
    assert live["node_command_jitter_ms"]["p50"] < 0.5 * 20.0, live["node_command_jitter_ms"]
    assert live["command_period_ms"]["p50"] >= 0.75 * 20.0, live["command_period_ms"]


def test_recording_holds_what_the_node_published(demo):
    result, _, _ = demo
    live = result.live
    with Bag(live["recording"]) as recording:
        assert {"/vla_node/command", "/vla_node/joint_trajectory", "/diagnostics"} <= set(recording.topics)
        trajectories = list(recording.messages(["/vla_node/joint_trajectory"]))
        commands = list(recording.messages(["/vla_node/command"]))
        first = recording.deserialize(trajectories[0][3], trajectories[0][1])
    assert len(trajectories) == live["chunks"] and len(commands) == live["commands"]
    assert list(first.joint_names)[-1] == "panda_gripper" and len(first.points) > 0


def test_demo_prints_what_a_user_wants(demo):
    result, text, out = demo
    for needle in ("chunks received:", "command rate:", "command jitter:", "latency per stage: preprocess",
                   "holds:", "plots:", str(out / "live" / "commands.png"), "max|dev| vs eager"):
        assert needle in text
    assert (out / "live" / "timing.png").exists() and (out / "offline" / "latency.png").exists()
    fused = result.offline["configs"][1]
    assert fused["label"] == "fused" and fused["vs_baseline"]["max_abs_dev"] < 1e-4
    # The quirky bag offline: a query for nearly every frame, one timeline restart.
    quirks = result.quirks["queries"]
    assert quirks["evaluated"] > 140 and quirks["timeline_restarts"] >= 1 and "sample_quirks.mcap" in text


def test_the_shipped_policy_reaches_for_the_cube_over_ros(demo):
    """The demo's closed loop: the trained default policy (vla_node/data/sim_policy) through the
    node, in lockstep with the 40 ms latency it was evaluated with (BENCHMARKS.md): the same run on
    any machine. Every tick commanded by the node, and its commands take the right gripper to the
    cube and touch it (gym-aloha's reward >= 1; random weights flail without touching it: reward
    0). The episode runs until success or 400 ticks (on the 2-core VM: success at tick 309, 0.32
    -> 0.12 m; reward 2 after 200 ticks)."""
    result, text, _ = demo
    assert result.closed_loop["lockstep"]
    (episode,) = result.closed_loop["per_episode"]
    assert episode["commands"] == episode["ticks"] and episode["held_without_command"] == 0, episode
    assert episode["max_reward"] >= 1, episode
    assert episode["gripper_to_cube_min_m"] < episode["gripper_to_cube_start_m"] - 0.1, episode
    assert f"seed {episode['seed']}: " in text and "node commands at 50 Hz sim time, in lockstep" in text


def test_live_with_sim_time(tmp_path):
    """A node on use_sim_time runs on the /clock the replay publishes from the bag's time."""
    with NodeProcess(tiny_config(), tmp_path / "node.log", {"use_sim_time": True}) as node:
        live = replay_live(LiveOptions(bag=SAMPLE_BAG, out=tmp_path / "live", wait_s=120.0, abort_if=node.exited),
                           progress=lambda m: None)
    assert live["clock"]
    with Bag(SAMPLE_BAG) as bag, Bag(live["recording"]) as recording:
        start, end = bag.start_ns, bag.end_ns
        stamps = [recording.deserialize(raw, msgtype).header.stamp
                  for _, msgtype, _, raw in recording.messages(["/vla_node/joint_trajectory"])]
    # Trajectory stamps come from the node's clock: the bag's time, not the wall clock's.
    assert stamps and all(start <= s.sec * 10**9 + s.nanosec <= end + 3 * 10**9 for s in stamps)
    assert chunks_answered(live) >= live["expected_chunks"] * 8 // chunk_period_ticks(live) // 2
    # The recording is on the bag's clock here (the node's): never faster than 50 Hz of sim time.
    # The replay paces that clock by the wall clock, and a timer whose executor falls behind a
    # jump of the clock fires once, not once per missed period: beside three busy loops and a
    # second suite the node made 40.7 Hz. Half the rate holds at that load with room to spare.
    assert 0.5 * 50.0 <= live["command_rate_hz"] <= 1.1 * 50.0


def test_live_errors(tmp_path):
    with pytest.raises(BagError, match="no bag at"):
        replay_live(LiveOptions(bag=tmp_path / "missing.mcap", out=tmp_path))
    with pytest.raises(LiveError, match="node /nobody not found"):
        replay_live(LiveOptions(bag=SAMPLE_BAG, node="/nobody", out=tmp_path, wait_s=0.5))


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    """A node on the wall clock, for replays other than the demo's."""
    with NodeProcess(tiny_config(), tmp_path_factory.mktemp("node") / "node.log") as running:
        yield running


def test_live_raw_sqlite_bag_at_double_speed(node, tmp_path):
    """Raw Image cameras pass through as they are (restamped), from a sqlite3 bag, at 2x; the
    recording is a sqlite3 bag too."""
    bag = write_sample_bag(tmp_path / "raw", SampleSpec(duration_s=2.0, compressed=False, reference=False), "sqlite3")
    live = replay_live(LiveOptions(bag=bag, rate=2.0, out=tmp_path / "live", storage="sqlite3", abort_if=node.exited),
                       progress=lambda m: None)
    assert live["published"] == {"/cameras/exo/image_raw": 30, "/cameras/wrist/image_raw": 30, "/joint_states": 200,
                                 "/instruction": 1}
    assert chunks_answered(live) >= max(1, live["expected_chunks"] * 8 // chunk_period_ticks(live) - 2)
    assert_commands_at_50_hz(live)   # the node's clock is the wall clock
    with Bag(live["recording"]) as recording:
        assert recording.storage == "sqlite3" and "/vla_node/command" in recording.topics


def test_live_partial_bag_plays_up_to_the_damage(node, tmp_path):
    bag = tmp_path / "cut.mcap"
    bag.write_bytes(SAMPLE_BAG.read_bytes()[:SAMPLE_BAG.stat().st_size // 2])
    live = replay_live(LiveOptions(bag=bag, out=tmp_path / "live", abort_if=node.exited), progress=lambda m: None)
    damage = live["bag_damage"]
    assert damage and "cut off at byte" in damage["reason"] and damage["summary"].startswith("stopped after")
    assert 0 < live["published"]["/cameras/exo/image_raw"] < 90
    assert chunks_answered(live) > 0    # computed from what played (on time or not)


def test_player_converts_to_the_node_input_types():
    """What the player publishes for each pairing of the bag's camera type with the node's."""
    rgb = np.kron(np.array([[[200, 30, 30], [30, 30, 200]]], np.uint8), np.ones((16, 16, 1), np.uint8))
    raw_image = bytes(TYPESTORE.serialize_cdr(image_msg(rgb, 1_000, "cam"), IMAGE))
    jpeg = bytes(TYPESTORE.serialize_cdr(compressed_image_msg(rgb, 1_000, "cam"), COMPRESSED_IMAGE))
    assert convert(Route("/c", IMAGE, "/c", IMAGE), raw_image, None) == raw_image        # as recorded
    for bag_type, data in ((IMAGE, raw_image), (COMPRESSED_IMAGE, jpeg)):
        for node_type in (IMAGE, COMPRESSED_IMAGE):
            out = TYPESTORE.deserialize_cdr(convert(Route("/c", bag_type, "/n", node_type), data, 500), node_type)
            assert (out.header.stamp.nanosec, out.header.frame_id) == (1_500, "cam")   # restamped
            assert np.abs(decode_image(out, "/n").astype(int) - rgb).mean() < 12


def test_a_read_request_whose_answer_is_lost_is_sent_again(monkeypatch):
    """The first GetState request goes out before its service exists, so nothing answers it (as
    when a service drops a response to a client it has not matched yet: CI saw the replay wait out
    its 120 s for that one answer); the replay asks again and takes the answer to the second."""
    import rclpy
    from lifecycle_msgs.srv import GetState
    from rclpy.executors import SingleThreadedExecutor

    from vla_node.tools import live

    monkeypatch.setattr(live, "RESEND_S", 0.5)
    context = rclpy.Context()
    rclpy.init(context=context)
    try:
        client_node = rclpy.create_node("reader", context=context, start_parameter_services=False)
        server_node = rclpy.create_node("server", context=context, start_parameter_services=False)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(client_node)
        executor.add_node(server_node)
        client = client_node.create_client(GetState, "late/get_state")
        requests = []

        def answer(request, response):
            response.current_state.label = "active"
            return response

        def send():
            future = client.call_async(GetState.Request())
            if not requests:   # the service appears only after the first request has gone out
                server_node.create_service(GetState, "late/get_state", answer)
            requests.append(future)
            return future

        wait = live.Waiter(executor, time.monotonic() + 60.0, None)
        result = live.read_service(send, wait.until, wait.deadline)
        assert result is not None and result.current_state.label == "active"
        assert len(requests) >= 2 and not requests[0].done()
    finally:
        executor.shutdown()
        context.try_shutdown()
