"""A dead engine process (killed, out of memory, a driver fault): the node holds and says so. By
default it stays that way until cleanup + configure; with engine_restart_s it starts a new engine
by itself, warms it up and resumes once the inputs are fresh, all of it logged and on
/diagnostics."""
import os
import signal
import time

import numpy as np
import pytest

from ros_helpers import Harness, NodeProcess, Robot, pid_alive, stamp_ns
from vla_node.ros.diagnostics import Key

pytestmark = pytest.mark.timeout(300)

LOST = "engine lost: engine process exited (code -9)"


def kill_the_engine(h) -> tuple[int, dict]:
    """SIGKILL the running node's engine process; returns its pid and the first report of the loss."""
    d = h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "the node to run", since=0)
    pid = int(d[Key.ENGINE_PID])
    start = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    lost = h.wait_diagnostics(lambda d: LOST in d["_message"], 60, "the loss on /diagnostics", since=start)
    assert lost["_level"] == 2 and lost[Key.ENGINE_PID] == "none (lost)"
    return pid, lost


def held_since(h, report: dict, count: int = 10) -> np.ndarray:
    """`count` commands the node stamped after `report`."""
    def after():
        commands = [m.position for m in h.messages("joint_command") if stamp_ns(m.header.stamp) > report["_stamp_ns"]]
        return commands if len(commands) >= count else None
    return np.array(h.wait_until(after, 60, f"{count} commands after the report")[:count])


def commands_to_report(h, since: dict, report: dict, period_ns: int = 20_000_000) -> int:
    """The commands the node stamped from its first chunk after `since` (its trajectory is stamped
    with the tick its plan starts at; less half a control period, config/tiny.yaml's 50 Hz) to
    `report`: by the node's stamps, so a busy machine's delays do not count."""
    first_ns = min(stamp_ns(t.header.stamp) for t in h.messages("trajectory")
                   if stamp_ns(t.header.stamp) > since["_stamp_ns"])
    return sum(first_ns - period_ns // 2 <= stamp_ns(m.header.stamp) <= report["_stamp_ns"]
               for m in h.messages("joint_command"))


def test_engine_restart_replaces_a_dead_engine_and_resumes():
    node = NodeProcess({"autostart": True, "engine_restart_s": 0.5, "publish_joint_command": True})
    h = Harness(node)
    try:
        Robot(h)
        pid, lost = kill_the_engine(h)
        node.wait_for_line(f"{LOST}; restarting it in 0.5 s (engine_restart_s)")
        commands = held_since(h, lost, 5)
        assert (commands == commands[0]).all()                       # holding while it has no engine
        node.wait_for_line("restarting the engine (attempt 1)")
        up = h.wait_diagnostics(lambda d: d["_message"] == "running" and d[Key.ENGINE_PID].isdigit(), 60,
                                "running on a new engine")
        assert int(up[Key.ENGINE_PID]) != pid and pid_alive(int(up[Key.ENGINE_PID])) and not pid_alive(pid)
        assert up[Key.ENGINE_RESTARTS] == "1"
        node.wait_for_line(f"engine restarted: tiny eager on cpu, engine process {up['engine_pid']}")
        node.wait_for_line("resolved: engine: engine lost")
        since = time.monotonic()
        h.wait_until(lambda: len(h.messages("trajectory", since)) >= 3, 60, "chunks from the new engine")
        # "running" right after the first tick that commands the new engine's first chunk, not at the
        # next periodic report, which the fault's end (announced the tick before) put a second later.
        held_since(h, up, 1)      # the commands up to the report are all here (one topic, in order)
        assert 1 <= commands_to_report(h, lost, up) <= 2
    finally:
        h.close()
        node.stop_cleanly()


def test_without_engine_restart_a_dead_engine_holds_until_cleanup_and_configure():
    node = NodeProcess({"autostart": True})
    h = Harness(node)
    try:
        Robot(h)
        _, lost = kill_the_engine(h)
        node.wait_for_line(f"{LOST}; cleanup and configure restart it (or set engine_restart_s)")
        later = h.wait_diagnostics(lambda d: d["_stamp_ns"] > lost["_stamp_ns"] + 2 * 10**9, 30, "reports 2 s later")
        assert LOST in later["_message"] and later[Key.ENGINE_RESTARTS] == "0"
        assert node.count("restarting the engine") == 0
        for transition in ("deactivate", "cleanup", "configure", "activate"):
            assert h.transition(transition), transition
        up = h.wait_diagnostics(lambda d: d["_message"] == "running", 60, "running after cleanup and configure")
        assert pid_alive(int(up[Key.ENGINE_PID]))
    finally:
        h.close()
        node.stop_cleanly()
