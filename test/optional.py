"""Packages some tests need beyond a ROS 2 install's: where one is missing, those tests skip with
the reason, as the CUDA tests do without a GPU, and collecting the suite never fails."""
import pytest

# The simulator (vla_node/sim) and its videos. requirements.txt pins them; rosdep installs mujoco
# and imageio (package.xml), but gym-aloha has no rosdep key: `pip install gym-aloha`.
SIMULATOR = ("mujoco", "gym_aloha", "imageio")


def require_simulator() -> None:
    """Skip the calling test, or the calling test module at import, without the simulator's packages."""
    for module in SIMULATOR:
        pytest.importorskip(module, reason=f"the simulator needs {module} (pip install -r requirements.txt; "
                                           "gym-aloha has no rosdep key)")
