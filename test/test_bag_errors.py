"""Bags the tools cannot (fully) use: missing, corrupt, partial, missing topics, unusable types.
Each gives the stated error, or is processed up to the damage with the report saying where."""
import json
import os
import shutil

import numpy as np
import pytest

from vla_node.runtime import LAYOUTS
from vla_node.tools.bag_io import (
    COMPRESSED_IMAGE,
    IMAGE,
    JOINT_STATE,
    STRING,
    TYPESTORE,
    Bag,
    BagError,
    BagWriter,
    ObservationStream,
    header_msg,
    resolve_inputs,
)
from vla_node.tools.replay import main as replay
from vla_node.tools.sample_bag import SAMPLE_BAG, SampleSpec, write_sample_bag

LAYOUT = LAYOUTS["droid"]


def offline(capsys, *args):
    rc = replay(["offline", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


def copy_bag(src, dst, storage, replace=None):
    """Copy every message of src into a new bag; replace(topic, index on topic, raw) may swap the bytes."""
    seen = {}
    with Bag(src) as bag, BagWriter(dst, storage) as writer:
        for topic, msgtype, time_ns, raw in bag.messages(list(bag.topics)):
            seen[topic] = seen.get(topic, -1) + 1
            data = replace(topic, seen[topic], raw) if replace else raw
            writer.write_cdr(topic, msgtype, time_ns, data)
    return dst


def cut(path, fraction):
    with open(path, "r+b") as f:
        f.truncate(int(os.path.getsize(path) * fraction))


def queries(path):
    with Bag(path) as bag:
        stream = ObservationStream(bag, resolve_inputs(bag, LAYOUT.cameras), LAYOUT, history_offset_s=8 / 15)
        return sum(1 for _ in stream), bag.damage, bag.notes, bag.start_ns


@pytest.fixture(scope="module")
def full_queries():
    return queries(SAMPLE_BAG)[0]


def test_missing_bag(tmp_path, capsys):
    rc, _, err = offline(capsys, tmp_path / "nope")
    assert rc == 2 and f"no bag at {tmp_path / 'nope'}" in err


def test_not_a_bag(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("hello")
    rc, _, err = offline(capsys, tmp_path / "notes.txt")
    assert rc == 2 and "is not a bag: expected a rosbag2 directory or a .mcap / .db3 file" in err
    (tmp_path / "empty").mkdir()
    rc, _, err = offline(capsys, tmp_path / "empty")
    assert rc == 2 and "is not a rosbag2 bag: no metadata.yaml, no .mcap or .db3 file" in err


@pytest.mark.parametrize("name", ["garbage.mcap", "garbage.db3"])
def test_corrupt_storage_file(tmp_path, capsys, name):
    (tmp_path / name).write_bytes(np.random.default_rng(0).bytes(20000))
    rc, _, err = offline(capsys, tmp_path / name)
    assert rc == 2 and "is not a readable rosbag2 bag" in err and "nothing before the damage could be recovered" in err


def test_truncated_mcap_is_processed_up_to_the_damage(tmp_path, capsys, full_queries):
    bag = tmp_path / "cut.mcap"
    shutil.copy(SAMPLE_BAG, bag)
    cut(bag, 0.5)
    n, damage, _, _ = queries(bag)
    assert 0 < n < full_queries
    assert "cut off at byte" in damage.reason and damage.messages_read > 0
    rc, out, _ = offline(capsys, bag, "--out", tmp_path / "report")
    assert rc == 0
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    stopped = report["bag"]["damage"]
    assert report["queries"]["evaluated"] == n
    assert 1.0 < stopped["last_time_s"] < 5.0 and "cut off at byte" in stopped["reason"]
    assert f"PARTIAL BAG: {stopped['summary']}" in out
    assert stopped["summary"].startswith(f"stopped after {stopped['messages_read']} messages, ")


def test_truncated_sqlite_is_processed_up_to_the_damage(tmp_path, full_queries):
    bag = copy_bag(SAMPLE_BAG, tmp_path / "bag", "sqlite3")
    cut(bag / "bag.db3", 0.6)
    n, damage, _, start = queries(bag)
    assert 0 < n < full_queries
    assert "table messages unreadable after" in damage.reason
    assert damage.describe(start).startswith(f"stopped after {damage.messages_read} messages, ")


def test_unreadable_message_stops_the_stream_there(tmp_path):
    bad = 40   # the 41st exterior frame is not a JPEG any more
    bag = copy_bag(SAMPLE_BAG, tmp_path / "bad.mcap", "mcap",
                   replace=lambda topic, i, raw: (
                       bytes(TYPESTORE.serialize_cdr(TYPESTORE.types[COMPRESSED_IMAGE](
                           header=header_msg(0), format="jpeg", data=np.zeros(64, np.uint8)), COMPRESSED_IMAGE))
                       if topic == "/cameras/exo/image_raw/compressed" and i == bad else raw))
    n, damage, _, _ = queries(bag)
    assert n == bad      # one query per frame before it (the first ones without history)
    assert "cannot use this image: corrupt jpeg data" in damage.reason


@pytest.mark.parametrize("storage", ["mcap", "sqlite3"])
def test_missing_metadata_yaml_reads_the_storage_file(tmp_path, storage, full_queries):
    bag = copy_bag(SAMPLE_BAG, tmp_path / "bag", storage)
    (bag / "metadata.yaml").unlink()
    n, damage, notes, _ = queries(bag)
    assert n == full_queries and damage is None
    assert "metadata.yaml missing or unusable" in notes[0]


def test_missing_topic(capsys):
    rc, _, err = offline(capsys, SAMPLE_BAG, "--camera-topics", "/cam/left,/cam/right")
    assert rc == 2 and "camera topic /cam/left (or /cam/left/compressed) is not in" in err
    assert "/cameras/exo/image_raw/compressed" in err   # says what the bag has
    rc, _, err = offline(capsys, SAMPLE_BAG, "--joint-states", "/franka/joint_states")
    assert rc == 2 and "topic /franka/joint_states is not in" in err


def test_unusable_message_type(tmp_path):
    bag = tmp_path / "wrong.mcap"
    with BagWriter(bag) as writer:
        writer.write("/joint_states", STRING, 1, TYPESTORE.types[STRING](data="not joints"))
    with Bag(bag) as opened, pytest.raises(BagError, match="topic /joint_states holds std_msgs/msg/String, which "
                                                         "cannot be used here"):
        opened.require("/joint_states", (JOINT_STATE,))


def test_unusable_image_encoding(tmp_path, capsys):
    path = write_sample_bag(tmp_path / "raw.mcap", SampleSpec(duration_s=0.2, compressed=False, reference=False))
    depth = copy_bag(path, tmp_path / "depth.mcap", "mcap", replace=lambda topic, i, raw: (
        bytes(TYPESTORE.serialize_cdr(TYPESTORE.types[IMAGE](
            header=header_msg(0), height=4, width=4, encoding="32FC1", is_bigendian=0, step=16,
            data=np.zeros(64, np.uint8)), IMAGE)) if topic.startswith("/cameras/") else raw))
    rc, _, err = offline(capsys, depth)
    assert rc == 2 and "cannot use this image: unsupported encoding '32FC1'" in err


def test_wrong_joint_count(tmp_path, capsys):
    rc, _, err = offline(capsys, SAMPLE_BAG, "--joint-names", "panda_joint1,panda_joint2", "--max-frames", "1",
                         "--out", tmp_path)
    assert rc == 2 and "2 joints ['panda_joint1', 'panda_joint2'], the model's state has 8" in err


def test_an_unstamped_camera_is_named(tmp_path, capsys):
    """A camera driver that sets no header stamp (all 0): no window can pair its frames, and the
    error says so rather than "waiting for camera 'wrist'"."""
    def unstamp(topic, i, raw):
        if topic != "/cameras/wrist/image_raw/compressed":
            return raw
        msg = TYPESTORE.deserialize_cdr(raw, COMPRESSED_IMAGE)
        msg.header = header_msg(0, msg.header.frame_id)
        return bytes(TYPESTORE.serialize_cdr(msg, COMPRESSED_IMAGE))
    path = copy_bag(write_sample_bag(tmp_path / "short.mcap", SampleSpec(duration_s=1.0, reference=False)),
                    tmp_path / "unstamped.mcap", "mcap", replace=unstamp)
    rc, _, err = offline(capsys, path, "--out", tmp_path / "out")
    assert rc == 2 and "no query could be formed" in err
    assert ("the last message dropped: /cameras/wrist/image_raw/compressed: unstamped frames (header.stamp 0): "
            "frames are paired and timed by their stamps, the camera driver must set them") in err
