"""bench/ holds scripts, not a package: put it on sys.path so tests can import their modules."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


@pytest.fixture
def mock_server(tmp_path):
    """A mock server (`python -m jserve.server --mock`) on a free loopback port, stopped after."""
    from server_process import ServerProcess, mock_command

    with ServerProcess(
        mock_command(["--mock-token-delay", "0.005"]), tmp_path / "mock.log", start_timeout=60
    ) as server:
        yield server


@pytest.fixture
def smoke_report(tmp_path):
    """run(script, *args): runs `bench/<script> --smoke *args --json FILE` in a fresh interpreter
    and returns (its JSON report, its CompletedProcess); a failed run fails the test."""

    def run(script: str, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
        out = tmp_path / f"{Path(script).stem}.json"
        result = subprocess.run(
            [sys.executable, str(BENCH_DIR / script), "--smoke", *args, "--json", str(out)],
            capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(out.read_text()), result

    return run
