"""bench/ holds scripts, not a package: put it on sys.path so tests can import their modules."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH_DIR) not in sys.path:
    sys.path.insert(0, str(BENCH_DIR))


@pytest.fixture
def mock_server(tmp_path):
    """A mock server (`python -m server --mock`) on a free loopback port; stopped afterwards."""
    from server_process import ServerProcess, mock_command

    with ServerProcess(
        mock_command(["--mock-token-delay", "0.005"]), tmp_path / "mock.log", start_timeout=60
    ) as server:
        yield server
