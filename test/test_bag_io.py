"""Bags in and out: every message type the replay tools read, publish or record survives a
write/read round trip in both storage formats and the trip through rclpy's serialisation."""
import importlib

import numpy as np
import pytest

from vla_node.runtime import LAYOUTS
from vla_node.tools.bag_io import (
    CLOCK,
    COMPRESSED_IMAGE,
    DIAGNOSTIC_ARRAY,
    FLOAT64_MULTI_ARRAY,
    IMAGE,
    JOINT_STATE,
    JOINT_TRAJECTORY,
    STRING,
    TYPESTORE,
    Bag,
    BagWriter,
    ObservationStream,
    canonical_cdr,
    compressed_image_msg,
    decode_image,
    image_msg,
    joint_state_msg,
    joint_trajectory_msg,
    resolve_inputs,
    stamp_ns,
    string_msg,
    time_msg,
    trajectory_positions,
)
from vla_node.tools.sample_bag import JOINT_NAMES, SampleSpec, write_sample_bag

T = TYPESTORE.types
# 8x8 blocks of one colour each: JPEG keeps them nearly exact, so colour order is checkable.
RGB = np.kron(np.array([[[220, 30, 30], [30, 200, 40]], [[40, 60, 210], [240, 240, 240]]], np.uint8),
              np.ones((8, 8, 1), np.uint8))
STAMP = 1_700_000_001_250_000_000


def diagnostic_array():
    status = T["diagnostic_msgs/msg/DiagnosticStatus"](
        level=b"\x01"[0], name="vla_node: inference", message="hold: inputs stale", hardware_id="cpu",
        values=[T["diagnostic_msgs/msg/KeyValue"](key="latency_ms", value="41.5")])
    return T[DIAGNOSTIC_ARRAY](header=T["std_msgs/msg/Header"](stamp=time_msg(STAMP), frame_id=""), status=[status])


def float64_multi_array():
    layout = T["std_msgs/msg/MultiArrayLayout"](dim=[T["std_msgs/msg/MultiArrayDimension"](label="joints", size=8,
                                                                                            stride=8)], data_offset=0)
    return T[FLOAT64_MULTI_ARRAY](layout=layout, data=np.linspace(-1, 1, 8))


SAMPLES = {
    IMAGE: lambda: image_msg(RGB, STAMP, "exo_camera_optical_frame"),
    COMPRESSED_IMAGE: lambda: compressed_image_msg(RGB, STAMP, "wrist_camera_optical_frame"),
    JOINT_STATE: lambda: joint_state_msg(STAMP, JOINT_NAMES, np.arange(8) * 0.1, np.ones(8)),
    STRING: lambda: string_msg("pick up the red cup – and put it in the bowl"),
    JOINT_TRAJECTORY: lambda: joint_trajectory_msg(STAMP, JOINT_NAMES, np.arange(16 * 8).reshape(16, 8) / 100,
                                                   66_666_667),
    FLOAT64_MULTI_ARRAY: float64_multi_array,
    DIAGNOSTIC_ARRAY: diagnostic_array,
    CLOCK: lambda: T[CLOCK](clock=time_msg(STAMP)),
}


def serialized(msgtype):
    return bytes(TYPESTORE.serialize_cdr(SAMPLES[msgtype](), msgtype))


@pytest.mark.parametrize("target", ["bag_dir_mcap", "bag_dir_sqlite3", "single.mcap", "single.db3"])
def test_every_message_type_round_trips(tmp_path, target):
    path = tmp_path / target
    storage = target.rsplit("_", 1)[-1] if target.startswith("bag_dir") else "mcap"
    topics = {msgtype: f"/t{i}" for i, msgtype in enumerate(SAMPLES)}
    with BagWriter(path, storage) as writer:
        for i, msgtype in enumerate(SAMPLES):
            writer.write_cdr(topics[msgtype], msgtype, STAMP + i, serialized(msgtype))
    with Bag(path) as bag:
        assert bag.storage == ("sqlite3" if "sqlite3" in target or target.endswith(".db3") else "mcap")
        assert bag.topics == {topic: msgtype for msgtype, topic in topics.items()}
        read = list(bag.messages(list(topics.values())))
        assert bag.damage is None
        assert [(topic, time_ns) for topic, _, time_ns, _ in read] == [(topics[m], STAMP + i)
                                                                       for i, m in enumerate(SAMPLES)]
        msgs = {msgtype: bag.deserialize(raw, msgtype) for _, msgtype, _, raw in read}
        for msgtype, (_, _, _, raw) in zip(SAMPLES, read):
            assert bytes(raw) == serialized(msgtype)
    assert np.array_equal(decode_image(msgs[IMAGE], "/t0"), RGB)
    assert stamp_ns(msgs[IMAGE].header.stamp) == STAMP and msgs[IMAGE].header.frame_id == "exo_camera_optical_frame"
    jpeg = decode_image(msgs[COMPRESSED_IMAGE], "/t1")
    # A swapped colour order would be off by ~100.
    assert jpeg.shape == RGB.shape and np.abs(jpeg.astype(int) - RGB).mean() < 12
    assert list(msgs[JOINT_STATE].name) == list(JOINT_NAMES)
    assert np.array_equal(msgs[JOINT_STATE].position, np.arange(8) * 0.1)
    assert msgs[STRING].data == "pick up the red cup – and put it in the bowl"
    assert np.array_equal(trajectory_positions(msgs[JOINT_TRAJECTORY]),
                          (np.arange(16 * 8).reshape(16, 8) / 100).astype(np.float32))
    assert msgs[JOINT_TRAJECTORY].points[1].time_from_start.nanosec == 2 * 66_666_667
    assert msgs[DIAGNOSTIC_ARRAY].status[0].values[0].value == "41.5"
    assert np.array_equal(msgs[FLOAT64_MULTI_ARRAY].data, np.linspace(-1, 1, 8))
    assert stamp_ns(msgs[CLOCK].clock) == STAMP


@pytest.mark.parametrize("msgtype", list(SAMPLES))
def test_rclpy_reads_our_bytes_and_we_read_rclpys(msgtype):
    """live publishes rosbags-serialised bytes through rclpy and records rclpy's bytes."""
    from rclpy.serialization import deserialize_message, serialize_message
    package, _, name = msgtype.split("/")
    rclpy_type = getattr(importlib.import_module(f"{package}.msg"), name)
    ours = serialized(msgtype)
    theirs = serialize_message(deserialize_message(ours, rclpy_type))
    assert canonical_cdr(theirs, msgtype) == ours


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_sample_bag_gives_observations_with_history(tmp_path, storage):
    path = write_sample_bag(tmp_path / "sample", SampleSpec(duration_s=1.4, compressed=storage == "mcap"), storage)
    layout = LAYOUTS["droid"]
    with Bag(path) as bag:
        inputs = resolve_inputs(bag, layout.cameras)
        assert inputs.reference == "/reference/joint_trajectory"
        suffix = "/compressed" if storage == "mcap" else ""
        assert [c.topic for c in inputs.cameras] == [f"/cameras/exo/image_raw{suffix}",
                                                     f"/cameras/wrist/image_raw{suffix}"]
        stream = ObservationStream(bag, inputs, layout, history_offset_s=8 / 15)
        frames = list(stream)
        waiting = ObservationStream(bag, inputs, layout, history_offset_s=8 / 15, wait_for_history=True)
        full = list(waiting)
    camera_frames = int(1.4 * 15)
    history = 8   # frames 8/15 s = 8 frames at 15 Hz
    assert stream.stats.first_camera_frames == camera_frames and len(frames) == camera_frames
    # Until the history frame exists, a query holds the newest frames only (as the policy's wrapper).
    assert stream.stats.partial_history == history
    assert [len(f.observation.images) for f in frames] == [2] * history + [4] * (camera_frames - history)
    assert waiting.stats.frames_without_history == history and len(full) == camera_frames - history
    first = frames[history].observation
    assert [f.observation.frame_ids for f in full] == [f.observation.frame_ids for f in frames[history:]]
    assert [img.shape for img in first.images] == [(480, 640, 3)] * 4
    (exo_old, t_old), (wrist_old, _), (exo_new, t_new), (wrist_new, _) = first.frame_ids
    assert (exo_old, wrist_old, exo_new, wrist_new) == ("exo", "wrist", "exo", "wrist")
    assert t_new - t_old == pytest.approx(history * 1e9 / 15, abs=1)
    assert first.stamp == t_new / 1e9 and frames[history].stamp_ns == t_new
    assert first.instruction == "pick up the red cup and put it in the bowl"
    assert first.state.shape == (8,) and first.state.dtype == np.float32
