"""The plumbing under the node's reliability, without a running node: the frame decoder's order
and timing, finding and removing what child processes leave behind, and how `vla-replay live`
finds a node (namespaces, a graph that has not caught up)."""
import fcntl
import os
import subprocess
import sys
import threading
import time

import pytest
import rclpy
from rclpy.executors import SingleThreadedExecutor

from vla_node.ros.inputs import Decoder
from vla_node.tools.bag_io import Bag
from vla_node.tools.live import LiveError, LiveOptions, Waiter, _node_topics, plan_playback
from vla_node.tools.node_process import SHM, processes_with_env, remove_dead_dds_shm
from vla_node.tools.sample_bag import SAMPLE_BAG


def test_decoder_serves_the_camera_waiting_longest_and_keeps_arrival_times():
    converted, busy, go_on = [], threading.Event(), threading.Event()

    def ingest(camera, msg, arrived_ns, fill):
        converted.append((camera, msg, arrived_ns))
        if len(converted) == 1:     # the first conversion is slow: frames pile up meanwhile
            busy.set()
            go_on.wait(30)

    decoder = Decoder(ingest)
    try:
        decoder.push(0, "exo 0", 100)
        assert busy.wait(30)
        decoder.push(1, "wrist 0", 200)
        decoder.push(0, "exo 1", 300)       # camera 0 keeps coming while camera 1 waits
        decoder.push(0, "exo 2", 400)
        go_on.set()
        deadline = time.monotonic() + 30
        while len(converted) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # Camera 1 waited longest: it goes first. Only camera 0's newest frame is kept, and each
        # frame carries the time it arrived, not the time it was converted.
        assert converted == [(0, "exo 0", 100), (1, "wrist 0", 200), (0, "exo 2", 400)]
        assert decoder.dropped == 1
    finally:
        decoder.close()


def test_decoder_drain_returns_once_every_pushed_frame_is_converted():
    """fixed_latency_s: each control tick drains the decoder first, so it sees every frame that
    arrived before it, however long conversions take on a busy machine."""
    converted, go_on = [], threading.Event()

    def ingest(camera, msg, arrived_ns, fill):
        go_on.wait(30)          # slow conversions: both frames are still waiting when drain() starts
        converted.append(msg)

    decoder = Decoder(ingest)
    try:
        decoder.push(0, "exo 0", 100)
        decoder.push(1, "wrist 0", 100)
        threading.Timer(0.2, go_on.set).start()
        decoder.drain()
        assert converted == ["exo 0", "wrist 0"]
    finally:
        decoder.close()


def test_dead_processes_shared_memory_is_removed_and_live_ones_kept():
    names = {f"fastdds_vlatest{os.getpid()}{k}" for k in ("dead", "live")}
    for name in names:
        (SHM / name).write_bytes(b"segment")
        (SHM / f"{name}_el").touch()
    live_lock = open(SHM / f"fastdds_vlatest{os.getpid()}live_el", "ab")
    fcntl.flock(live_lock, fcntl.LOCK_EX)       # what a running Fast DDS participant holds
    try:
        removed = remove_dead_dds_shm({n for name in names for n in (name, f"{name}_el")})
        dead = f"fastdds_vlatest{os.getpid()}dead"
        assert sorted(removed) == [dead, f"{dead}_el"]
        assert (SHM / f"fastdds_vlatest{os.getpid()}live").exists()
    finally:
        live_lock.close()
        for name in names:
            for path in (SHM / name, SHM / f"{name}_el"):
                path.unlink(missing_ok=True)


def test_processes_are_found_by_an_environment_marker_wherever_they_run():
    marker = f"vla-test-{os.getpid()}-{time.monotonic_ns()}"
    # A grandchild, orphaned at once: it is found although it is nobody's child here.
    script = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])"
    subprocess.run([sys.executable, "-c", script], env={**os.environ, "VLA_MARKER": marker}, check=True)
    # Popen returns once the exec is past its point of no return, before the kernel has set up the
    # new environment: /proc reads it empty for that moment, longer on a loaded machine
    deadline = time.monotonic() + 30
    while not (pids := processes_with_env("VLA_MARKER", marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        assert len(pids) == 1
    finally:
        for pid in pids:
            os.kill(pid, 9)
    deadline = time.monotonic() + 30
    while processes_with_env("VLA_MARKER", marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not processes_with_env("VLA_MARKER", marker)


@pytest.fixture
def ros_node():
    context = rclpy.Context()
    rclpy.init(context=context)
    node = rclpy.create_node("plumbing_probe", context=context)
    executor = SingleThreadedExecutor(context=context)
    executor.add_node(node)
    yield node, executor
    executor.shutdown()
    node.destroy_node()
    context.try_shutdown()


def test_replay_waits_for_a_node_the_graph_does_not_know_yet(ros_node):
    # The node's services can answer before this process's graph lists the node: asking for its
    # publishers then raises in rclpy; the replay keeps waiting and ends with its own words.
    node, executor = ros_node
    with pytest.raises(LiveError, match="node /nobody/here does not publish"):
        _node_topics(node, Waiter(executor, time.monotonic() + 1.0, None), "/nobody/here")


def test_replay_publishes_into_the_node_namespace_and_reads_the_bag_topics_without_it():
    params = {"camera_names": ["exo", "wrist"], "camera_topics": ["cameras/exo/image_raw", "cameras/wrist/image_raw"],
              "joint_states_topic": "joint_states", "instruction_topic": "instruction", "control_rate_hz": 50.0,
              "joint_names": [f"j{i}" for i in range(8)]}
    with Bag(SAMPLE_BAG) as bag:
        plan = plan_playback(bag, params, LiveOptions(bag=SAMPLE_BAG), False, "/robot1/vla_node")
    routes = {r.bag_topic: r.node_topic for r in plan.routes}
    assert routes == {"/cameras/exo/image_raw/compressed": "/robot1/cameras/exo/image_raw",
                      "/cameras/wrist/image_raw/compressed": "/robot1/cameras/wrist/image_raw",
                      "/joint_states": "/robot1/joint_states", "/instruction": "/robot1/instruction"}
    assert plan.instruction_topic == "/robot1/instruction"
