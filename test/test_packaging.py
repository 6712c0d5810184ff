"""What a ROS 2 install reads from the package: colcon runs this suite with pytest only if
setup.py names pytest as a test dependency (else it falls back to unittest and runs nothing),
and rosdep installs only what package.xml lists."""
import ast
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_setup_py_names_the_test_dependencies_colcon_looks_for():
    # As colcon reads setup.py: distutils' run_setup up to the configuration, in an interpreter of its own.
    code = ("from distutils.core import run_setup; "
            "dist = run_setup('setup.py', script_args=('--dry-run',), stop_after='config'); "
            "print(repr(dist.extras_require))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    extras = ast.literal_eval(done.stdout.strip().splitlines()[-1])
    assert {"pytest", "pytest-timeout", "hypothesis", "ruff"} <= set(extras["test"])


def test_package_xml_lists_the_python_dependencies():
    package = ET.parse(ROOT / "package.xml").getroot()
    run = {e.text for e in package.iter("exec_depend")}
    test = {e.text for e in package.iter("test_depend")}
    assert {"python3-numpy", "python3-opencv", "python3-yaml", "python3-torch", "python3-transformers-pip",
            "python3-matplotlib", "python3-rosbags-pip"} <= run
    assert {"python3-pytest", "python3-pytest-timeout", "python3-hypothesis", "launch_pytest"} <= test
