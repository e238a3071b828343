"""The run's one process with 3 virtual CPU devices (tests/parallel/three_device_child.py),
started once for every test that reads its report, and the slow second one that serves
SmolLM2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.run_lock import run_lock

ROOT = Path(__file__).resolve().parents[2]


def _three_device_report(*args: str) -> dict:
    """Runs `python -m tests.parallel.three_device_child *args` on 3 devices; its report."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=3"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    out = subprocess.run(
        [sys.executable, "-m", "tests.parallel.three_device_child", *args],
        capture_output=True, text=True, env=env, timeout=900, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.split("REPORT")[1])


@pytest.fixture(scope="session")
def three_devices(default_model, tmp_path_factory, worker_id) -> dict:
    """The 3-device process's report (its module docstring says what it holds); default_model
    fills the conversion cache first.

    Two files read it, which pytest-xdist may give to two workers: the first to ask starts the
    process and leaves its report in the run's shared directory (tests/run_lock.py), where the
    other reads it instead of starting a second process."""
    with run_lock(tmp_path_factory, worker_id, "three_devices") as shared:
        report = shared / "three_devices.json"
        if not report.exists():
            report.write_text(json.dumps(_three_device_report()))
    return json.loads(report.read_text())


@pytest.fixture(scope="session")
def three_devices_smollm2(default_model) -> dict:
    """A second 3-device process's report: SmolLM2 served on 1 and on 3 devices (slow)."""
    return _three_device_report("smollm2")
