"""Fixtures of the benchmark tests: bench/ is a package, importable from the repository root
(where pytest runs), and its scripts run as `python -m bench.NAME` from there."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.server_process import ServerProcess, mock_command

ROOT = Path(__file__).resolve().parents[2]


def run_bench(module: str, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`python -m bench.MODULE ARGS` from the repository root, in a fresh interpreter."""
    return subprocess.run(
        [sys.executable, "-m", f"bench.{module}", *args],
        capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip


@pytest.fixture(scope="module")
def mock_server(tmp_path_factory):
    """One mock server (`python -m jserve.server --mock`) on a free loopback port for a module's
    tests, stopped after them."""
    log = tmp_path_factory.mktemp("mock") / "mock.log"
    with ServerProcess(
        mock_command(["--mock-token-delay", "0.005"]), log, start_timeout=60
    ) as server:
        yield server


@pytest.fixture(scope="session")
def smollm2():
    """(GGUF reader, ModelConfig) of the default model, read once for the tests that count its
    weights."""
    import gguf

    from jserve.loaders.gguf_file import config_from_gguf
    from jserve.loaders.model_source import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    return reader, config_from_gguf(reader, "SmolLM2")


@pytest.fixture
def smoke_report(tmp_path):
    """run(module, *args): runs `python -m bench.<module> --smoke *args --json FILE` and returns
    (its JSON report, its CompletedProcess); a failed run fails the test."""

    def run(module: str, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
        out = tmp_path / f"{module}.json"
        result = run_bench(module, "--smoke", *args, "--json", str(out))
        assert result.returncode == 0, result.stderr[-3000:]
        return json.loads(out.read_text()), result

    return run
