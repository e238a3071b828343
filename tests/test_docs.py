"""docs/ must describe code that exists: every `path.py:name` hop it names is defined there."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOP = re.compile(r"`((?:jserve|server|bench)/[\w/]+\.py):([\w.]+)`")


def _defined_names(path: Path) -> set[str]:
    """Dotted names of the classes, functions and methods defined in a module."""
    names: set[str] = set()

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(prefix + child.name)
                visit(child, f"{prefix}{child.name}.")

    visit(ast.parse(path.read_text(), str(path)), "")
    return names


def test_every_hop_in_the_docs_exists():
    hops = [
        (doc.name, file, name)
        for doc in sorted((ROOT / "docs").glob("*.md"))
        for file, name in HOP.findall(doc.read_text())
    ]
    assert len(hops) >= 10, "docs/architecture.md should walk a request through the code"
    missing = [
        f"{doc}: {file}:{name}"
        for doc, file, name in hops
        if not (ROOT / file).exists() or name not in _defined_names(ROOT / file)
    ]
    assert not missing, missing


def test_readme_refers_to_nothing_outside_the_repo():
    readme = (ROOT / "README.md").read_text()
    assert "../" not in readme
    for link in re.findall(r"`((?:docs|bench|jserve|server)/[\w./-]+)`", readme):
        assert (ROOT / link).exists(), link


def fields_table() -> str:
    """jserve.core.control.FIELDS as a Markdown table, as docs/scheduling.md holds it."""
    from jserve.core.control import FIELDS

    rows = ["| field | takes | what it sets |", "| --- | --- | --- |"]
    rows += [f"| `{f.name}` | {f.takes} | {f.help} |" for f in FIELDS.values()]
    return "\n".join(rows)


def test_the_admin_fields_table_is_the_declaration():
    doc = (ROOT / "docs" / "scheduling.md").read_text()
    found = re.search(r"<!-- control-fields:.*?-->\n(.*?)\n<!-- /control-fields -->", doc, re.S)
    assert found, "docs/scheduling.md lost its control-fields block"
    assert found.group(1) == fields_table(), "regenerate it: tests.test_docs.fields_table()"
