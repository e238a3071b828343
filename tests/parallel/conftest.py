"""The run's one process with 3 virtual CPU devices (tests/parallel/three_device_child.py),
started once for every test that reads its report."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def three_devices(default_model) -> dict:  # default_model fills the conversion cache
    """The 3-device process's report (its module docstring says what it holds)."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "tests.parallel.three_device_child"],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("REPORT")[1])
