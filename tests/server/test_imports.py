"""The server talks to the engine through its interface only: importing it loads no JAX."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def test_server_imports_no_jax():
    code = (
        "import sys, jserve.server.app, jserve.server.cli, jserve.server.runner\n"
        "import jserve.server.mock_engine, jserve.server.__main__\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'jaxlib', 'flax'))\n"
        "assert not heavy, heavy\n"
    )
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True, timeout=60)
