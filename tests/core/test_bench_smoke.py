"""The scheduler benchmark measures the scenario it names, and its report adds up."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_NUMBER = r"([0-9.]+)"
_RESULT = re.compile(
    rf"(\d+) running decodes, (\d+) waiting: p50 {_NUMBER} ms  p90 {_NUMBER} ms  p99 {_NUMBER} ms "
    rf"wall; CPU p50 {_NUMBER} ms  p99 {_NUMBER} ms"
)
_STATE = re.compile(r"state after: running=(\d+) waiting=(\d+) kv_usage=([0-9.]+)")


def test_scheduler_bench_smoke():
    result = subprocess.run(
        [sys.executable, "-m", "bench.scheduler_cost", "--smoke"],
        capture_output=True, text=True, timeout=120, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    states = [tuple(map(float, m.groups())) for m in _STATE.finditer(result.stdout)]
    results = [tuple(map(float, m.groups())) for m in _RESULT.finditer(result.stdout)]
    assert [r[:2] for r in results] == [(256, 1024), (1024, 1024)], result.stdout
    for (running, waiting, kv_usage), (target, queued, p50, p90, p99, cpu50, cpu99) in zip(
        states, results, strict=True
    ):
        # The measured iterations ran at the load the label names (a few may just have ended).
        assert 0.95 * target <= running <= target and 0.95 * queued <= waiting <= queued
        assert 0 < kv_usage < 1
        assert 0 < p50 <= p90 <= p99 and 0 < cpu50 <= cpu99
        assert cpu50 <= p50 * 1.05  # thread CPU time cannot exceed wall time
