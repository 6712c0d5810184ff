"""Style is a test, as ament_python's test_flake8 is: ruff with the configuration in
pyproject.toml (line length 120, pycodestyle, pyflakes, import order) over the package, the tests
and the scripts. `make test` installs ruff (requirements.txt); without it the test is skipped."""
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def ruff() -> list[str]:
    if importlib.util.find_spec("ruff") is not None:
        return [sys.executable, "-m", "ruff"]
    found = shutil.which("ruff")
    if found is None:
        pytest.skip("ruff is not installed (pip install -r requirements.txt, or the test extra)")
    return [found]


def test_ruff_finds_nothing():
    done = subprocess.run(ruff() + ["check", "--no-cache", "--output-format", "concise", "vla_node", "test", "scripts"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
