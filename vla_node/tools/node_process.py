"""Starting and stopping `vla-node` as a child process: shared by the demo, the replay tests and
the node tests."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path


def node_command() -> list[str]:
    """`vla-node` next to this interpreter (pip puts console scripts there), else the module."""
    script = Path(sys.executable).parent / "vla-node"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vla_node.ros.node"]


def ros_domain(seed: int | None = None) -> str:
    """A random ROS domain in 30..101: the ports of higher domains fall into Linux's ephemeral
    range, where another socket can take them and discovery fails."""
    return str(random.Random(seed).randint(30, 101))


def large_data_transport() -> None:
    """Fast DDS's shared-memory large-data transport: its default transports lose most raw
    640x480 frames. Not combined with localhost-only discovery, which falls back to UDP and
    loses about half of them again."""
    os.environ["FASTDDS_BUILTIN_TRANSPORTS"] = "LARGE_DATA"


def interrupt(proc: subprocess.Popen, timeout_s: float = 20.0) -> int:
    """Ctrl-C, as a user would (the node ends its engine process and exits); killed if it
    does not exit in time. The process must run in its own session (start_new_session)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode
