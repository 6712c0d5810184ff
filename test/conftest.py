import os
import signal
import time
from multiprocessing import resource_tracker

import pytest
import torch

from vla_node.tools.node_process import (
    claim_ros_domain,
    dds_shm_files,
    processes_with_env,
    remove_dead_dds_shm,
    ros_environment,
)

HAS_CUDA = torch.cuda.is_available()
ROS_VARIABLES = ("ROS_DOMAIN_ID", "FASTDDS_DEFAULT_PROFILES_FILE", "FASTDDS_BUILTIN_TRANSPORTS", "ROS_LOG_DIR",
                 "VLA_TEST_DOMAIN", "VLA_TEST_MODULE")
_last_domain = [None]

# multiprocessing's spawn start method (the live replay's player) starts a resource tracker that
# lives as long as this process: started now, it carries no test module's marker and is not
# taken for something a module left running.
resource_tracker.ensure_running()

# Triton kernels run on the CPU through the interpreter where there is no GPU. Set before any
# test module imports triton-decorated code.
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs a CUDA device (run `-m cuda` on the GPU machine)")


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run on the GPU machine: pytest -m cuda)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


def own_compile_worker(pid: int) -> bool:
    """torch.compile's worker pool (a sidecar process and its forks) belongs to this pytest process
    and lives as long as it does; it carries the environment of the module that compiled first.
    Killed, it leaves inductor writing into a dead pipe: the next new kernel waits forever (seen on
    the H200). Pools of engine or node processes name another parent and still count."""
    try:
        argv = open(f"/proc/{pid}/cmdline", "rb").read().split(b"\0")
    except OSError:
        return False
    return any(b"torch/_inductor/compile_worker" in a for a in argv) and f"--parent={os.getpid()}".encode() in argv


@pytest.fixture(scope="module", autouse=True)
def own_ros_domain_and_nothing_left_behind(request):
    """Each test module gets a ROS domain of its own, so nothing it starts hears another module's
    nodes, publishers or /clock: one from VLA_TEST_DOMAINS (e.g. 40-60) if set, never the
    ROS_DOMAIN_ID the suite was started with, and none that another test run on this machine holds
    (claim_ros_domain). Afterwards nothing it started still runs (every process it started carries
    VLA_TEST_MODULE in its environment, however deep) and the Fast DDS shared memory its processes
    left (killed ones leave theirs) is removed."""
    saved = {name: os.environ.get(name) for name in ROS_VARIABLES}
    domain, claim = claim_ros_domain(avoid=_last_domain[0])
    _last_domain[0] = domain
    marker = f"{os.getpid()}:{request.module.__name__}"
    os.environ.update(VLA_TEST_DOMAIN=domain, VLA_TEST_MODULE=marker)
    ros_environment(domain)
    shm_before = dds_shm_files()
    yield
    for name, value in saved.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    deadline = time.monotonic() + 30.0      # a stopped node's engine process may take a moment
    while (left := [pid for pid in processes_with_env("VLA_TEST_MODULE", marker) if not own_compile_worker(pid)]) \
            and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    remove_dead_dds_shm(dds_shm_files() - shm_before)
    claim.close()
    assert not left, f"{request.module.__name__} left processes running: {left} (killed now)"
