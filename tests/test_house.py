"""House rules the code keeps: no function in jserve/ or server/ runs over MAX_FUNCTION_LINES;
the files the suite starts first (tests/conftest.py:HEAVY_FIRST) exist."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.contracts import ROOT

MAX_FUNCTION_LINES = 60


def long_functions(path: Path, root: Path = ROOT, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Each function in `path` longer than `limit` lines, counted from its `def` to its last
    line (decorators not counted), nested ones included, as "path:Class.function (N lines)"
    with the path relative to `root`."""
    found = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                lines = child.end_lineno - child.lineno + 1  # type: ignore[operator]
                if lines > limit:
                    found.append(f"{path.relative_to(root)}:{prefix}{child.name} ({lines} lines)")
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(path.read_text()), "")
    return found


def test_no_function_is_longer_than_the_limit():
    paths = [p for folder in ("jserve", "server") for p in sorted((ROOT / folder).rglob("*.py"))]
    assert len(paths) > 50  # the walk found the code
    too_long = [f for p in paths for f in long_functions(p)]
    assert not too_long, "split these by meaning:\n" + "\n".join(too_long)


def test_the_count_finds_long_functions_nested_ones_and_methods(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    source = (
        f"def short():\n{body}\n\n"
        f"class C:\n    def method(self):\n{body.replace('    ', '        ')}\n\n"
        f"def outer():\n    def inner():\n{body.replace('    ', '        ')}\n    return inner\n"
    )
    (tmp_path / "m.py").write_text(source)
    assert long_functions(tmp_path / "m.py", tmp_path, limit=4) == [
        "m.py:short (5 lines)",
        "m.py:C.method (5 lines)",
        "m.py:outer (7 lines)",
        "m.py:outer.inner (5 lines)",
    ]
    assert long_functions(tmp_path / "m.py", tmp_path, limit=5) == ["m.py:outer (7 lines)"]


def test_the_heavy_files_exist_and_are_handed_out_first():
    from types import SimpleNamespace

    from tests.conftest import HEAVY_FIRST, pytest_collection_modifyitems

    missing = [path for path in HEAVY_FIRST if not (ROOT / path).is_file()]
    assert not missing, f"tests/conftest.py:HEAVY_FIRST names files that are gone: {missing}"
    first, second = HEAVY_FIRST[:2]
    ids = ["tests/a.py::x", f"{second}::y", "tests/b.py::z", f"{first}::w", f"{second}::v"]
    items = [SimpleNamespace(nodeid=nodeid) for nodeid in ids]
    pytest_collection_modifyitems(items)
    assert [item.nodeid for item in items] == [
        f"{first}::w", f"{second}::y", f"{second}::v", "tests/a.py::x", "tests/b.py::z"
    ]  # fmt: skip
