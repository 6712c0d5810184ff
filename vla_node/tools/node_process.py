"""Starting and stopping `vla-node` as a child process, and finding what such processes leave
behind: shared by the demo, the replay tests, the node tests and the benchmarks."""
from __future__ import annotations

import fcntl
import os
import random
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..ros import FRAME_TRANSPORT_PROFILE


def node_command() -> list[str]:
    """`vla-node` next to this interpreter (pip puts console scripts there), else the module."""
    script = Path(sys.executable).parent / "vla-node"
    return [str(script)] if script.exists() else [sys.executable, "-m", "vla_node.ros.main"]


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


# Where a test or a demo may pick its ROS domain: VLA_TEST_DOMAINS (e.g. `40-60`, inclusive), so that
# test runs side by side, or beside a robot, can be given ranges of their own; else 30..101 (the
# ports of higher domains fall into Linux's ephemeral range, where another socket can take them
# and discovery fails).
DOMAINS_VARIABLE = "VLA_TEST_DOMAINS"
DEFAULT_DOMAINS = range(30, 102)
MAX_DOMAIN = 232      # the highest domain whose ports are valid (the ROS 2 domain ID rules)
# The domain this process was started in (a robot's, or the user's): never picked.
STARTED_IN_DOMAIN = os.environ.get("ROS_DOMAIN_ID")
DOMAIN_LOCKS = Path(tempfile.gettempdir()) / "vla_node_ros_domains"


def ros_domains(spec: str | None = None, exclude: str | None = STARTED_IN_DOMAIN) -> list[int]:
    """The domains ros_domain() picks from: `spec` (default: $VLA_TEST_DOMAINS, e.g. "40-60" or
    "45"), else DEFAULT_DOMAINS, without `exclude` (default: the ROS_DOMAIN_ID this process was
    started with). Raises ValueError with a sentence for a malformed or empty range."""
    spec = os.environ.get(DOMAINS_VARIABLE, "") if spec is None else spec
    if spec.strip():
        low, _, high = spec.partition("-")
        try:
            domains = range(int(low), int(high or low) + 1)
        except ValueError:
            domains = range(0)
        if not domains or domains.start < 0 or domains.stop > MAX_DOMAIN + 1:
            raise ValueError(f"{DOMAINS_VARIABLE}={spec!r}: expected a range of ROS domains such as 40-60, "
                             f"within 0..{MAX_DOMAIN}")
    else:
        domains = DEFAULT_DOMAINS
    left = [d for d in domains if str(d) != (exclude or "").strip()]
    if not left:
        raise ValueError(f"{DOMAINS_VARIABLE}={spec!r} holds only ROS_DOMAIN_ID {exclude}, which is never picked")
    return left


def ros_domain(seed: int | None = None) -> str:
    """A random domain of ros_domains()."""
    return str(random.Random(seed).choice(ros_domains()))


def claim_ros_domain(avoid: str | None = None):
    """A domain of ros_domains() that no other process on this machine has claimed, in random order
    with `avoid` last (the previous test module's: its participants may linger a moment), and the
    open lock file that holds the claim until it is closed (or the process exits). Raises
    RuntimeError when every one is claimed."""
    allowed = ros_domains()
    domains = [str(d) for d in random.sample(allowed, len(allowed))]
    domains.sort(key=lambda d: d == avoid)
    DOMAIN_LOCKS.mkdir(exist_ok=True)
    for domain in domains:
        lock = open(DOMAIN_LOCKS / domain, "w")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            lock.close()
            continue
        return domain, lock
    raise RuntimeError(f"every ROS domain of {allowed[0]}..{allowed[-1]} is claimed by another test run on this "
                       f"machine: give each run a range of its own ({DOMAINS_VARIABLE}=40-60)")



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


# -- what child processes leave behind ------------------------------------------------------------
SHM = Path("/dev/shm")


def dds_shm_files() -> set[str]:
    """Fast DDS shared-memory files now in /dev/shm: segments and ports, with their lock files."""
    return {p.name for p in SHM.glob("*fastdds*")} if SHM.is_dir() else set()


def dds_shm_of(pid: int) -> set[str]:
    """The Fast DDS shared-memory files a live process maps: its own segment and ports, and the
    segments of the participants it receives from."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {line.rsplit("/", 1)[1] for line in maps.splitlines() if f"{SHM}/" in line and "fastdds" in line}


def dead_dds_shm(names: set[str]) -> list[str]:
    """Those of `names` (Fast DDS shared-memory segments and ports) whose owner has exited: their
    lock file is no longer locked, the rule `fastdds shm clean` follows. A participant that is
    destroyed removes its files; a process that exits without destroying it (killed, or its
    context never finalized) leaves them."""
    return sorted(n for n in names if not n.endswith(("_el", "_sl")) and not n.startswith("sem.")
                  and any((SHM / f"{n}{lock}").exists() and not _locked(SHM / f"{n}{lock}") for lock in ("_el", "_sl")))


def remove_dead_dds_shm(names: set[str]) -> list[str]:
    """Remove the files of those of `names` whose owner has exited (dead_dds_shm): each one's
    segment, lock and mutex files. Returns the names removed."""
    bases = {n[:-3] if n.endswith(("_el", "_sl")) else n.removeprefix("sem.").removesuffix("_mutex") for n in names}
    removed = []
    for base in dead_dds_shm(bases):
        for name in (base, f"{base}_el", f"{base}_sl", f"sem.{base}_mutex"):
            try:
                (SHM / name).unlink()
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _locked(path: Path) -> bool:
    try:
        with open(path, "ab") as f:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)   # released on close
        return False
    except OSError:
        return True


def processes_with_env(name: str, value: str) -> list[int]:
    """Live processes (other than this one) whose environment sets name=value: the children,
    grandchildren and orphans of whoever set it, wherever they were reparented. A process in the
    middle of an exec (its new environment not yet set up) reads as empty, so one just started can
    be missed for a moment: callers wait for what they expect."""
    entry = f"{name}={value}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if entry in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:
            continue   # exited meanwhile, or not ours to read
    return pids
