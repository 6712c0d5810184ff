"""The package's layers: model/ <- runtime/ <- ros/, tools/. Checked on the source (every import
statement, TYPE_CHECKING ones included) so a circle or a wrong-way import fails here first."""
import ast
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "vla_node"


def imports_of(path: Path) -> set[str]:
    """Modules of vla_node that `path` imports, as dotted names."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    if path.name == "__init__.py":
        module = package
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.startswith("vla_node"):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("vla_node"))
    known = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
             for p in PACKAGE.rglob("*.py")}
    return {t for t in found if t in known and t != module}


def graph(subpackage: str) -> dict[str, set[str]]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts): imports_of(p)
            for p in (PACKAGE / subpackage).glob("*.py") if p.name != "__init__.py"}


@pytest.mark.parametrize("subpackage", ["model", "runtime"])
def test_no_import_circle(subpackage):
    g = graph(subpackage)
    state: dict[str, int] = {}

    def visit(node, path):
        if state.get(node) == 1:
            raise AssertionError(f"import circle: {' -> '.join(path + [node])}")
        if state.get(node) == 2 or node not in g:
            return
        state[node] = 1
        for nxt in g[node]:
            visit(nxt, path + [node])
        state[node] = 2

    for node in g:
        visit(node, [])


@pytest.mark.parametrize("lower, upper", [("model", ("runtime", "ros", "tools", "sim")),
                                           ("runtime", ("ros", "tools", "sim"))])
def test_imports_point_down(lower, upper):
    for module, targets in graph(lower).items():
        wrong = [t for t in targets if t.split(".")[1] in upper]
        assert not wrong, f"{module} imports {wrong}"


def import_alone(module: str) -> str:
    """Why `module` fails to import on its own in a fresh interpreter where rclpy cannot be imported
    ("" if it does not)."""
    code = ("import sys; sys.modules['rclpy'] = None\n"
            f"import {module}\n"
            "assert not any(m.startswith('rclpy') and sys.modules[m] is not None for m in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    return "" if done.returncode == 0 else f"{module}:\n{done.stderr[-2000:]}"


def test_model_and_runtime_import_alone_without_ros():
    """Each module of model/ and runtime/ imports on its own, without ROS (the GPU machine has
    none): an interpreter a module, as many side by side as the machine has cores (each spends its
    time importing torch)."""
    modules = sorted(".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts)
                     for sub in ("model", "runtime") for p in (PACKAGE / sub).glob("*.py") if p.name != "__init__.py")
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        failed = [why for why in pool.map(import_alone, modules) if why]
    assert len(modules) > 20 and not failed, "\n".join(failed)
