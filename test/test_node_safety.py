"""A model whose output is not finite: the node holds, never publishes it, and says why once."""
import time

import numpy as np
import pytest
import torch

from ros_helpers import HOME, Harness, NodeProcess, Robot
from vla_node.model import build_model, get_preset, init_random_, save_checkpoint

pytestmark = pytest.mark.timeout(120)


def test_non_finite_actions_are_never_published(tmp_path):
    model = init_random_(build_model(get_preset("tiny")), seed=0)
    with torch.no_grad():
        model.expert.action_out.weight.fill_(float("nan"))
    save_checkpoint(model, tmp_path / "nan")

    node = NodeProcess({"autostart": True, "checkpoint": str(tmp_path / "nan")})
    h = Harness(node)
    try:
        Robot(h)
        start = time.monotonic()
        d = h.wait_diagnostics(lambda d: "non-finite actions" in d["_message"], 60, "the non-finite chunk",
                               since=start)
        assert d["_level"] == 2
        # Every chunk is non-finite: requests keep going out, the cause is logged once.
        h.wait_diagnostics(lambda d: int(d["requests"]) >= 5, 30, "more inference requests")
        commands = np.array([m.data for m in h.wait_commands(20, since=start)])
        np.testing.assert_array_equal(commands, np.broadcast_to(HOME, commands.shape))   # held where it stood
        assert not h.messages("trajectory")
        node.wait_for_line("holding: output: the chunk has non-finite actions")
        assert node.count("holding: output:") == 1
        assert node.proc.poll() is None
    finally:
        h.close()
        assert node.stop() == 0
