"""Starting and stopping `vla-node` as a child process: shared by the demo, the replay tests and
the node tests."""
from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence


def node_command() -> list[str]:
    """`vla-node` next to this interpreter (pip puts console scripts there), else the module."""
    script = Path(sys.executable).parent / "vla-node"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vla_node.ros.node"]


def node_argv(params_file: Path, overrides: Mapping[str, Any] | None = None, ros_args: Sequence[str] = ()) -> list[str]:
    """`vla-node --ros-args --params-file FILE -p name:=value ... ROS_ARGS`, each value a Python
    value written as the YAML that gives the parameter its type."""
    argv = node_command() + ["--ros-args", "--params-file", str(params_file)]
    for name, value in (overrides or {}).items():
        argv += ["-p", f"{name}:={_yaml(value)}"]
    return argv + list(ros_args)


def _yaml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_yaml(v) for v in value) + "]"
    if isinstance(value, str):
        return f"'{value}'" if value else "''"
    return repr(value)


def ros_domain(seed: int | None = None) -> str:
    """A random ROS domain in 30..101: the ports of higher domains fall into Linux's ephemeral
    range, where another socket can take them and discovery fails."""
    return str(random.Random(seed).randint(30, 101))


FRAME_TRANSPORT_PROFILE = Path(__file__).resolve().parents[1] / "data" / "fastdds_large_frames.xml"


def ros_environment(domain: str | None = None, log_dir: Path = Path("out") / "ros_log") -> str:
    """For this process and the children it starts: ROS domain `domain` (None: the one set, else
    a random one, so a demo or test does not hear other runs), the frame transport, logs under
    `log_dir` unless ROS_LOG_DIR is set. Returns the domain."""
    if domain is not None:
        os.environ["ROS_DOMAIN_ID"] = domain
    os.environ.setdefault("ROS_DOMAIN_ID", ros_domain())
    frame_transport()
    os.environ.setdefault("ROS_LOG_DIR", str(log_dir))
    return os.environ["ROS_DOMAIN_ID"]


def frame_transport() -> None:
    """Fast DDS with shared memory big enough for raw 640x480 frames (its default transports
    lose most of them) and UDP for discovery, for this process and the children it starts.
    Not the LARGE_DATA builtin: its TCP transport can deadlock a participant's teardown."""
    os.environ.pop("FASTDDS_BUILTIN_TRANSPORTS", None)   # it would replace the profile's transports
    os.environ["FASTDDS_DEFAULT_PROFILES_FILE"] = str(FRAME_TRANSPORT_PROFILE)


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
