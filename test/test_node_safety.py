"""A model whose output is not finite: the node holds, never publishes it, and says why once; one
whose network itself gives non-finite actions fails its configure (warm-up) in one line."""
import time

import numpy as np
import pytest
import torch

from ros_helpers import HOME, Harness, NodeProcess, Robot
from vla_node.model import build_model, get_preset, init_random_, save_checkpoint
from vla_node.ros.diagnostics import Key
from vla_node.runtime import EngineConfig, PolicyEngine

pytestmark = pytest.mark.timeout(300)


def nan_on_instruction_checkpoint(folder, instruction: str) -> str:
    """The tiny model with NaN embeddings for the tokens of `instruction` that warm-up's prompt does not
    hold: finite through warm-up, non-finite on every query with that instruction."""
    model = init_random_(build_model(get_preset("tiny")), seed=0)
    save_checkpoint(model, folder)
    engine = PolicyEngine(EngineConfig(checkpoint=str(folder)))
    images = len(engine.layout.cameras), engine.layout.frames
    unseen = set(engine.prompts.build(*images, instruction).ids) - \
        set(engine.prompts.build(*images, engine.dummy_observation().instruction).ids)
    assert unseen
    with torch.no_grad():
        model.llm.embed.weight[sorted(unseen)] = float("nan")
    save_checkpoint(model, folder)
    return str(folder)


def test_non_finite_actions_are_never_published(tmp_path):
    instruction = "wipe the table with the sponge"
    node = NodeProcess({"autostart": True, "instruction": instruction,
                        "checkpoint": nan_on_instruction_checkpoint(tmp_path / "nan", instruction)})
    h = Harness(node)
    try:
        Robot(h)
        start = time.monotonic()
        d = h.wait_diagnostics(lambda d: "non-finite actions" in d["_message"], 60, "the non-finite chunk",
                               since=start)
        assert d["_level"] == 2
        # Every chunk is non-finite: requests keep going out, the cause is logged once.
        h.wait_diagnostics(lambda d: int(d[Key.REQUESTS]) >= 5, 60, "more inference requests")
        commands = np.array([m.data for m in h.wait_commands(20, since=start)])
        np.testing.assert_array_equal(commands, np.broadcast_to(HOME, commands.shape))   # held where it stood
        assert not h.messages("trajectory")
        node.wait_for_line("holding: output: the chunk has non-finite actions")
        assert node.count("holding: output:") == 1
        assert node.proc.poll() is None
    finally:
        h.close()
        node.stop_cleanly()


def test_a_network_giving_non_finite_actions_fails_configure_in_one_line(tmp_path):
    model = init_random_(build_model(get_preset("tiny")), seed=0)
    with torch.no_grad():
        model.expert.action_out.weight.fill_(float("nan"))
    save_checkpoint(model, tmp_path / "nan")
    node = NodeProcess({"autostart": True, "checkpoint": str(tmp_path / "nan")})
    h = Harness(node)
    try:
        line = node.wait_for_line("configure failed", timeout=120)
        assert "warm-up gave non-finite actions (the eager pass; float32 on cpu)" in line
        d = h.wait_diagnostics(lambda d: "configure failed" in d["_message"], 30, "the failure on /diagnostics",
                               since=0)
        assert d["_level"] == 2 and d[Key.STATE] == "unconfigured" and "\n" not in d[Key.CONFIGURE_ERROR]
        assert not h.messages("trajectory") and node.proc.poll() is None
    finally:
        h.close()
        node.stop_cleanly()


def test_a_camera_on_a_clock_behind_holds_with_the_reason():
    """A camera driver stamping on its own clock, 2 s behind the other camera: its frames keep
    arriving, so no input is stale; the node used to say "waiting for camera 'wrist'" forever."""
    from builtin_interfaces.msg import Time
    node = NodeProcess({"autostart": True})
    h = Harness(node)
    try:
        robot = Robot(h)
        robot.camera_messages[1] = lambda camera, stamp, seq: robot.image(
            camera, Time(sec=stamp.sec - 2, nanosec=stamp.nanosec), seq)
        d = h.wait_diagnostics(lambda d: "clock behind" in d["_message"], 30, "the camera's clock", since=0)
        assert d["_level"] >= 1 and "holding" in d["_message"] and "camera 'wrist' has no frame within " \
            "sync_slop_s of camera 'exo', its newest is over 0.5 s older: stopped, or stamped on a clock behind" \
            in d["_message"]
        assert int(d[Key.REQUESTS]) == 0 and not h.messages("trajectory")
        h.wait_diagnostics(lambda d: True, 30, "another diagnostics message")
        assert node.count("holding: sync: camera 'wrist'") == 1
    finally:
        h.close()
        node.stop_cleanly()


def test_joint_states_on_another_clock_hold_with_the_reason_until_state_sync_newest():
    from builtin_interfaces.msg import Time
    node = NodeProcess({"autostart": True})
    h = Harness(node)
    try:
        robot = Robot(h)
        # Joint states stamped 2 s behind the cameras: pairing them by stamp is impossible, and the
        # newest one would be the wrong state for the frames. Hold, say why (once), send nothing.
        robot.joint_message = lambda stamp: robot.joint_state(Time(sec=stamp.sec - 2, nanosec=stamp.nanosec))
        d = h.wait_diagnostics(lambda d: "state_slop_s" in d["_message"], 30, "the stamp mismatch", since=0)
        assert d["_level"] >= 1 and "and none after them yet" in d["_message"]
        h.wait_diagnostics(lambda d: True, 30, "another diagnostics message")
        assert int(h.diagnostics_since(0)[-1][Key.REQUESTS]) == 0 and not h.messages("trajectory")
        commands = np.array([m.data for m in h.wait_commands(10)])
        np.testing.assert_array_equal(commands, np.broadcast_to(HOME, commands.shape))
        # A user who knows the stamps are wrong can pair with the newest state instead.
        assert h.set_parameter("state_sync", "newest").successful
        h.wait_until(lambda: h.messages("trajectory"), 60, "a trajectory with state_sync newest")
        assert node.count("holding: sync: no joint state stamped within state_slop_s") == 1
    finally:
        h.close()
        node.stop_cleanly()
