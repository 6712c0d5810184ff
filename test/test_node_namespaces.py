"""Two robots side by side: two nodes started with the same params file in namespaces /robot1 and
/robot2 each listen to their own robot's cameras and joint states (the input topics are
relative) and command only it."""
import time

import numpy as np
import pytest
import yaml

from ros_helpers import HOME, ROOT, Harness, NodeProcess, Robot
from vla_node.ros.diagnostics import Key
from vla_node.ros.params import SPECS

INPUT_TOPICS = ("camera_topics", "joint_states_topic", "instruction_topic", "estop_topic")

pytestmark = pytest.mark.timeout(300)

# The second robot stands elsewhere: a node hearing the wrong robot would command from there.
HOME2 = HOME + np.array([0.1, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1, -0.1])


def test_two_namespaced_nodes_serve_two_robots_side_by_side():
    nodes = [NodeProcess({"autostart": True}, namespace=ns) for ns in ("/robot1", "/robot2")]
    harnesses = []
    try:
        for node, home in zip(nodes, (HOME, HOME2)):
            h = Harness(node)
            harnesses.append(h)
            robot = Robot(h)
            robot.joints = home.copy()
        for h in harnesses:
            assert h.node.get_namespace() == "/" and h.joint_pub.topic_name == f"{h.process.namespace}/joint_states"
            h.wait_diagnostics(lambda d: d["_message"] == "running", 60, f"{h.target} to run", since=0)
        since = time.monotonic()
        for h, home in zip(harnesses, (HOME, HOME2)):
            h.wait_until(lambda: len(h.messages("trajectory", since)) >= 3, 60, f"chunks from {h.target}")
            # Its commands start where its own robot stands.
            first = np.array(h.messages("command")[0].data)
            np.testing.assert_allclose(first, home)
            # A report with no fault: on a loaded machine this test's own camera publishers can stall
            # past input_timeout_s (0.5 s wall clock), and the node then rightly reports them stale
            # for a while (a CI run on the busy 2-core VM saw one such report first).
            h.wait_diagnostics(lambda d: d[Key.FAULTS] == "none" and int(d[Key.CHUNKS]) >= 3, 60,
                               f"a report without faults from {h.target}", since=since)
    finally:
        for h in harnesses:
            h.close()
        for node in nodes:
            node.stop_cleanly()


@pytest.mark.parametrize("source", ["defaults", "config/tiny.yaml", "config/molmobot.yaml"])
def test_input_topics_are_relative_so_a_namespace_moves_them(source):
    if source == "defaults":
        values = {name: SPECS[name].default for name in INPUT_TOPICS}
    else:
        values = yaml.safe_load((ROOT / source).read_text())["/**/vla_node"]["ros__parameters"]
    topics = [t for name in INPUT_TOPICS for t in np.atleast_1d(values[name])]
    assert topics and not [t for t in topics if t.startswith("/")]
