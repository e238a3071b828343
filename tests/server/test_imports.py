"""The server talks to the engine through its interface only: importing it loads no JAX."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path


def test_server_imports_no_jax():
    code = (
        "import sys, server.app, server.cli, server.runner, server.mock_engine, server.__main__\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not heavy, heavy\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)


def test_library_never_imports_the_app():
    """jserve/ is the library the server is built on: no module of it may import server."""
    root = Path(__file__).resolve().parents[2]
    offenders = []
    for path in sorted((root / "jserve").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            offenders += [
                f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "server"
            ]
    assert not offenders, offenders
