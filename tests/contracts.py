"""Check jserve's import contracts (pyproject.toml's [tool.importlinter]) with import-linter.

The app's folder `server/` installs as `jserve.server` (setuptools package-dir), but grimp,
which builds import-linter's graph, walks only a package's own folder. So the check runs on the
tree as it installs: `jserve/` with `server/` copied in as `jserve/server/`.

`python -m tests.contracts` (from the repository root) prints import-linter's report and exits
with its status; `.ci/run` runs it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def assemble(dst: Path, root: Path = ROOT) -> Path:
    """Copy jserve/ and server/ (as jserve/server/) and pyproject.toml into `dst`."""
    skip = shutil.ignore_patterns("__pycache__", "*.so")
    shutil.copytree(root / "jserve", dst / "jserve", ignore=skip)
    shutil.copytree(root / "server", dst / "jserve" / "server", ignore=skip)
    shutil.copy(root / "pyproject.toml", dst / "pyproject.toml")
    return dst


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """import-linter on an assembled tree (its own copy of jserve first on the path)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run(
        [sys.executable, "-c", "from importlinter.cli import lint_imports_command as c; c()",
         "--no-cache"],
        cwd=tree, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def contracts(root: Path = ROOT) -> list[dict]:
    with open(root / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["importlinter"]["contracts"]


def layer_table(root: Path = ROOT) -> str:
    """docs/architecture.md's layer table, rendered from the contracts: a module imports only
    from its own package and the layers below (never up, never a sibling of its layer), and never
    what a forbidden contract names."""
    by_id = {c["id"]: c for c in contracts(root)}
    never: dict[str, list[str]] = {}
    for c in by_id.values():
        if c["type"] == "forbidden":
            how = " (directly)" if c.get("allow_indirect_imports") else ""
            for source in c["source_modules"]:
                never.setdefault(source, []).extend(f"`{m}`{how}" for m in c["forbidden_modules"])
    rows = ["| layer | package | never imports |"]
    rows.append("|---|---|---|")
    for i, tier in enumerate(by_id["layers"]["layers"]):
        for package in (p.strip() for p in tier.split("|")):
            banned = ", ".join(never.get(package, [])) or "-"
            rows.append(f"| {i + 1} | `{package}` | {banned} |")
    return "\n".join(rows) + "\n"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        result = lint_imports(assemble(Path(tmp)))
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
