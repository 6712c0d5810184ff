"""Packages some tests need beyond a ROS 2 install's: where one is missing, those tests skip with
the reason, as the CUDA tests do without a GPU, and collecting the suite never fails."""
import importlib.util

import pytest

# The simulator (vla_node/sim) and its videos. requirements.txt pins them; rosdep installs mujoco
# and imageio (package.xml), but gym-aloha has no rosdep key: `pip install gym-aloha`.
SIMULATOR = ("mujoco", "gym_aloha", "imageio")


def require_simulator() -> None:
    """Skip the calling test, or the calling test module at import, without the simulator's
    packages. Looked up, not imported: vla_node.sim.aloha must import mujoco first, after choosing
    its GL back end (imported earlier, mujoco keeps its default one and cannot render headless)."""
    missing = [module for module in SIMULATOR if importlib.util.find_spec(module) is None]
    if missing:
        pytest.skip(f"the simulator needs {', '.join(missing)} (pip install -r requirements.txt; gym-aloha has no "
                    "rosdep key)", allow_module_level=True)
