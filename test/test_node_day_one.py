"""What a ROS 2 user hits on day one: start-up parameters the node refuses end in one line and
exit code 1 (never a traceback), a node without a checkpoint refuses to configure unless random
weights are asked for, use_sim_time without /clock says so, and a silent camera says whether
anything publishes on its topic."""
import subprocess

import pytest

from ros_helpers import TINY_YAML, Harness, NodeProcess, Robot, ros_env
from vla_node.ros.diagnostics import Key
from vla_node.tools.node_process import node_argv

pytestmark = pytest.mark.timeout(300)


def start_with(params_file, overrides) -> subprocess.CompletedProcess:
    return subprocess.run(node_argv(params_file, overrides), capture_output=True, text=True, env=ros_env(),
                          timeout=90)


@pytest.mark.parametrize("overrides, message", [
    ({"control_rate_hz": 5000.0}, "control_rate_hz must be within [1.0, 1000.0]"),
    ({"handover": "bogus"}, "handover must be one of ['rtc', 'average', 'inpaint'], got 'bogus'"),
    ({"control_rate_hz": 15}, "control_rate_hz must be a double, written with a decimal point (15.0, not 15)"),
    ({"camera_topics": "cameras/exo"}, "camera_topics must be a list of strings"),
], ids=["out of range", "unknown value", "integer for a double", "wrong type"])
def test_refused_start_up_parameters_end_in_one_line_and_exit_code_1(overrides, message):
    done = start_with(TINY_YAML, overrides)
    assert done.returncode == 1
    assert (done.stdout + done.stderr).splitlines() == [f"vla_node: invalid parameters: {message}"]


def test_an_integer_for_a_double_in_the_params_file_ends_in_one_line(tmp_path):
    params = tmp_path / "robot.yaml"
    params.write_text(TINY_YAML.read_text().replace("control_rate_hz: 50.0", "control_rate_hz: 15"))
    done = start_with(params, {})
    assert done.returncode == 1
    assert (done.stdout + done.stderr).splitlines() == [
        "vla_node: invalid parameters: control_rate_hz must be a double, written with a decimal point (15.0, not 15)"]


def test_without_a_checkpoint_configure_fails_unless_random_weights_are_asked_for():
    node = NodeProcess({"autostart": True, "random_weights": False})
    try:
        line = node.wait_for_line("configure failed", timeout=60)
        assert "no checkpoint: set checkpoint to a MolmoBot checkpoint folder" in line
        assert "vla-convert OFFICIAL_DIR OUT_DIR" in line and "random_weights: true" in line
        assert node.count("loaded") == 0                  # no engine was started
        assert node.proc.poll() is None                   # still up, saying why on /diagnostics
    finally:
        node.stop_cleanly()


def test_use_sim_time_without_clock_says_the_active_node_waits_for_clock():
    # No /clock in this module's ROS domain.
    node = NodeProcess({"autostart": True, "use_sim_time": True})
    h = Harness(node)
    try:
        d = h.wait_diagnostics(lambda d: d.get(Key.STATE) == "active", 60, "the node to be active", since=0)
        assert d["_message"] == "holding: no /clock: use_sim_time is true and no simulated time has arrived yet"
    finally:
        h.close()
        node.stop_cleanly()


def test_a_silent_camera_says_whether_anything_publishes_on_its_topic_and_blames_no_transport_without_losses():
    # Camera exo: the harness has a publisher on its topic (matched) that has sent nothing yet, as
    # vla-replay live's player before it plays, then frames, then a gap: none of it is the
    # transport's doing (that hint needs DDS's message-lost events: test_node_units). Camera wrist:
    # nobody publishes.
    node = NodeProcess({"autostart": True, "camera_topics": ["cameras/exo/image_raw", "cameras/none/image_raw"]})
    h = Harness(node)
    try:
        robot = Robot(h)
        robot.cameras_on = [False, False]
        ns = node.namespace
        d = h.wait_diagnostics(lambda d: "camera 'exo' stale" in d[Key.FAULTS]
                               and "camera 'wrist' stale" in d[Key.FAULTS], 30, "both cameras stale", since=0)
        assert "camera 'exo' stale: no camera 'exo' input for more than 0.5 s (input_timeout_s)" in d[Key.FAULTS]
        assert "has a publisher" not in d[Key.FAULTS] and "Fast DDS" not in d[Key.FAULTS]
        assert f"no camera 'wrist' input for more than 0.5 s (input_timeout_s); nothing publishes on " \
               f"{ns}/cameras/none/image_raw" in d[Key.FAULTS]
        robot.cameras_on = [True, False]
        h.wait_diagnostics(lambda d: "camera 'exo' stale" not in d[Key.FAULTS], 60, "camera exo arriving")
        robot.cameras_on = [False, False]                # a gap in a camera whose frames had been arriving
        d = h.wait_diagnostics(lambda d: "camera 'exo' stale" in d[Key.FAULTS], 30, "camera exo stale again")
        assert "has a publisher" not in d[Key.FAULTS] and "Fast DDS" not in d[Key.FAULTS]
    finally:
        h.close()
        node.stop_cleanly()
