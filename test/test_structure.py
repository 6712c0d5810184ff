"""The package's shape, checked from its source (ast): no function over MAX_FUNCTION_LINES lines,
no import circle among the modules of vla_node/ros, and ros/node.py under NODE_MAX_LINES lines
(the lifecycle and the adapters between it and ROS; the rules live elsewhere)."""
import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "vla_node"
MAX_FUNCTION_LINES = 80
NODE_MAX_LINES = 300


def functions(tree: ast.AST):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node


def test_no_function_is_longer_than_80_lines():
    long = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for f in functions(ast.parse(path.read_text(), str(path))):
            lines = f.end_lineno - f.lineno + 1
            if lines > MAX_FUNCTION_LINES:
                long.append(f"{path.relative_to(PACKAGE.parent)}:{f.lineno} {f.name} ({lines} lines)")
    assert not long, "functions over 80 lines: " + ", ".join(long)


def ros_imports(path: Path) -> set[str]:
    """The vla_node.ros modules `path` imports, under TYPE_CHECKING too (a circle all the same)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.level == 1:    # from .x import ... / from . import x
            names = [node.module] if node.module else [a.name for a in node.names]
            found |= {n.split(".")[0] for n in names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vla_node.ros."):
            found.add(node.module.split(".")[2])
    return {n for n in found if (PACKAGE / "ros" / f"{n}.py").exists()}


def test_no_import_circle_in_ros():
    graph = {p.stem: ros_imports(p) for p in (PACKAGE / "ros").glob("*.py")}
    circles = []

    def visit(module: str, path: list[str]) -> None:
        for imported in sorted(graph.get(module, ())):
            if imported in path:
                circles.append(" -> ".join(path[path.index(imported):] + [imported]))
            elif len(path) < len(graph):
                visit(imported, path + [imported])

    for module in sorted(graph):
        visit(module, [module])
    assert not circles, f"import circles in vla_node/ros: {sorted(set(circles))[:5]}"


def test_the_node_module_stays_small():
    lines = len((PACKAGE / "ros" / "node.py").read_text().splitlines())
    assert lines < NODE_MAX_LINES, f"ros/node.py has {lines} lines"


def test_the_checks_catch_what_they_look_for(tmp_path):
    """A function of 81 lines is found; a circle a -> b -> a is found."""
    source = "def f():\n" + "    x = 1\n" * 80
    assert [f.end_lineno - f.lineno + 1 for f in functions(ast.parse(source))] == [81]
    (tmp_path / "a.py").write_text("from .b import x\n")
    (tmp_path / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import y\n")
    global PACKAGE
    saved, PACKAGE = PACKAGE, tmp_path
    try:
        (tmp_path / "ros").mkdir()
        for name in ("a", "b"):
            (tmp_path / "ros" / f"{name}.py").write_text((tmp_path / f"{name}.py").read_text())
        assert ros_imports(tmp_path / "ros" / "a.py") == {"b"} and ros_imports(tmp_path / "ros" / "b.py") == {"a"}
    finally:
        PACKAGE = saved
