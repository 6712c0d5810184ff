"""What a ROS 2 install reads from the package: colcon runs this suite with pytest only if
setup.py names pytest as a test dependency (else it falls back to unittest and runs nothing),
rosdep installs only what package.xml lists, and every command the README names exists."""
import ast
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def setup_keyword(name: str):
    """A keyword setup.py passes to setup(), as colcon reads it: distutils' run_setup up to the
    configuration, in an interpreter of its own."""
    code = ("from distutils.core import run_setup; "
            "dist = run_setup('setup.py', script_args=('--dry-run',), stop_after='config'); "
            f"print(repr(dist.{name}))")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    return ast.literal_eval(done.stdout.strip().splitlines()[-1])


def test_setup_py_names_the_test_dependencies_colcon_looks_for():
    assert {"pytest", "pytest-timeout", "hypothesis", "ruff"} <= set(setup_keyword("extras_require")["test"])


def readme_code() -> str:
    """The README's code: fenced blocks and inline spans, where its commands are."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```.*?\n(.*?)```", text, re.S)
    return "\n".join(blocks + re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)))


def test_every_command_the_readme_names_is_a_console_script_or_a_make_target():
    code = readme_code()
    scripts = {entry.split("=")[0].strip() for entry in setup_keyword("entry_points")["console_scripts"]}
    # pip puts these on PATH; colcon installs them in lib/vla_node, where `ros2 run vla_node X` finds them.
    named = set(re.findall(r"(?<![\w/.-])vla-[a-z]+(?:-[a-z]+)*", code)) | set(re.findall(r"ros2 run vla_node (\S+)",
                                                                                       code))
    assert {"vla-node", "vla-replay", "vla-train"} <= named      # the parsing finds them
    assert named <= scripts, f"the README names commands setup.py does not install: {sorted(named - scripts)}"
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), re.M))
    made = set(re.findall(r"(?<![\w-])make ([a-z][\w-]*)", code))
    assert {"demo", "test"} <= made
    assert made <= targets, f"the README names make targets the Makefile lacks: {sorted(made - targets)}"


def test_package_xml_lists_the_python_dependencies():
    package = ET.parse(ROOT / "package.xml").getroot()
    run = {e.text for e in package.iter("exec_depend")}
    test = {e.text for e in package.iter("test_depend")}
    assert {"python3-numpy", "python3-opencv", "python3-yaml", "python3-torch", "python3-transformers-pip",
            "python3-matplotlib", "python3-rosbags-pip", "python3-mujoco-pip", "python3-imageio"} <= run
    assert {"python3-pytest", "python3-pytest-timeout", "python3-hypothesis", "python3-ruff-pip",
            "launch_pytest"} <= test


def ros_imports(folder: str) -> set[str]:
    """The ROS packages that the Python files under `folder` import, or import or skip (rclpy, launch*,
    *_msgs, *_interfaces)."""
    found = set()
    for path in (ROOT / folder).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                found.add(node.module.split(".")[0])
            elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" \
                    and isinstance(node.args[0], ast.Constant):
                found.add(node.args[0].value.split(".")[0])
    return {m for m in found if m == "rclpy" or m.startswith("launch") or m.endswith(("_msgs", "_interfaces"))}


def test_package_xml_declares_every_ros_package_the_code_imports_and_nothing_unused():
    package = ET.parse(ROOT / "package.xml").getroot()
    run = {e.text for e in package.iter("exec_depend")}
    test = {e.text for e in package.iter("test_depend")}
    assert ros_imports("vla_node") | ros_imports("launch") <= run
    assert ros_imports("test") <= run | test
    ros_test = {d for d in test if not d.startswith("python3-")}
    assert ros_test <= ros_imports("test"), f"test dependencies nothing imports: {ros_test - ros_imports('test')}"


# pytest in an interpreter where the simulator's packages cannot be imported, as on a machine that
# rosdep set up (gym-aloha has no rosdep key).
WITHOUT_SIMULATOR = """
import sys

for name in {blocked!r}:
    sys.modules[name] = None     # import raises ModuleNotFoundError, importlib.util.find_spec says None
import pytest
sys.exit(pytest.main(sys.argv[1:]))
"""


def test_the_suite_collects_without_the_simulator_and_says_what_it_skips():
    from optional import SIMULATOR

    code = WITHOUT_SIMULATOR.format(blocked=set(SIMULATOR))
    done = subprocess.run([sys.executable, "-c", code, "--collect-only", "-q", "-rs", "-p", "no:cacheprovider", "test"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    skipped = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    assert any("the simulator needs" in line for line in skipped), done.stdout[-3000:]
    # A module that needs the simulator in one test only keeps the others.
    assert "test/test_train.py::test_objective_decreases_on_a_fixed_batch" in done.stdout


def test_the_per_test_timeout_is_in_the_pytest_configuration(pytestconfig):
    # colcon test runs pytest without make's command line: the configuration must carry it.
    assert float(pytestconfig.getini("timeout")) == 600
