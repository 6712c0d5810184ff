"""Two robots, one engine: two namespaced nodes attached to one vla-engine-server (engine_server)
are both commanded from its one engine, their queries batched (B = 2 on /diagnostics); the server
killed makes both hold and say why, and with engine_restart_s they attach to a new server by
themselves and resume; then one node killed mid-run leaves the other commanding."""
import os
import signal
import time

import numpy as np
import pytest

from ros_helpers import HOME, EngineServer, Harness, NodeProcess, Robot, stamp_ns
from vla_node.ros.diagnostics import Key

pytestmark = pytest.mark.timeout(300)

# Long enough that the two nodes' queries meet (each asks every few control ticks); waited out
# only while one node attached sends nothing (starting up), and never by a node alone.
BATCH_WINDOW_MS = 1000.0


def chunks_after(h: Harness, since: float, count: int = 3) -> None:
    h.wait_until(lambda: len(h.messages("trajectory", since)) >= count, 60, f"{count} chunks from {h.target}")


def commands_after(h: Harness, report: dict, count: int) -> np.ndarray:
    """The first `count` commands the node stamped after `report`."""
    def after():
        commands = [m.position for m in h.messages("joint_command") if stamp_ns(m.header.stamp) > report["_stamp_ns"]]
        return commands if len(commands) >= count else None
    return np.array(h.wait_until(after, 60, f"{count} commands after the report")[:count])


def test_two_nodes_share_one_engine_server_and_survive_each_others_faults(tmp_path):
    path = str(tmp_path / "engine.sock")
    server = EngineServer(path, batch_window_ms=BATCH_WINDOW_MS)
    # 10 Hz: a chunk of 16 actions spans 1.6 s, so chunks arrive in time on a busy 2-core machine
    # (two engines' worth of queries on one tiny CPU engine took ~0.7 s each beside 2 busy loops)
    params = {"autostart": True, "engine_server": path, "engine_restart_s": 0.5, "publish_joint_command": True,
              "control_rate_hz": 10.0}
    nodes = [NodeProcess(params, namespace=ns) for ns in ("/robot1", "/robot2")]
    harnesses = []
    try:
        for node, offset in zip(nodes, (0.0, 0.1)):
            h = Harness(node)
            harnesses.append(h)
            Robot(h).joints = HOME + offset
        for h in harnesses:
            d = h.wait_diagnostics(lambda d: d["_message"] == "running", 60, f"{h.target} to run", since=0)
            assert d[Key.ENGINE_PID] == str(server.proc.pid) and d[Key.ENGINE_SERVER] == path   # one engine
        since = time.monotonic()
        for h in harnesses:
            chunks_after(h, since)
            # a report with queue times and no faults (on a busy machine an earlier one may say this
            # test's own camera publishers stalled past input_timeout_s)
            d = h.wait_diagnostics(lambda d: Key.ms(Key.ENGINE_QUEUE, "p50") in d and d[Key.FAULTS] == "none", 60,
                                   "queue times without faults", since=since)
            assert float(d[Key.ms(Key.ENGINE_QUEUE, "max")]) >= 0.0
        server.wait_for("session 1 attached (2 now)")
        # Their queries met in the batching window: one engine query for both robots.
        d = harnesses[0].wait_diagnostics(lambda d: d.get(Key.ENGINE_BATCH_SIZE_MAX) == "2", 60, "a batch of two",
                                          since=since)
        assert d[Key.ENGINE_BATCH_SIZE] in ("1", "2") and float(d[Key.ms(Key.ENGINE_BATCH_WAIT, "max")]) >= 0.0

        # The server dies: both robots hold, say why, and attach again to a new server.
        start = time.monotonic()
        os.kill(server.proc.pid, signal.SIGKILL)
        for h in harnesses:
            lost = h.wait_diagnostics(lambda d: "engine server" in d["_message"], 60, "the loss", since=start)
            assert f"engine lost: engine server {path} closed the connection" in lost["_message"]
            assert lost["_level"] == 2
            held = commands_after(h, lost, 5)
            assert (held == held[0]).all()
        os.unlink(path)   # the killed server's socket: a new server replaces a stale one anyway
        server = EngineServer(path)
        for node in nodes:
            node.wait_for_line("engine restarted: tiny eager on cpu", 120)
        for h in harnesses:
            chunks_after(h, time.monotonic())

        # One robot's node dies mid-run: the other keeps being served.
        nodes[0].proc.send_signal(signal.SIGKILL)
        nodes[0].proc.wait(10)
        server.wait_for("ended (1 left)")
        chunks_after(harnesses[1], time.monotonic())
    finally:
        for h in harnesses:
            h.close()
        nodes[0].proc.kill()
        nodes[1].stop_cleanly()
        server.stop()
