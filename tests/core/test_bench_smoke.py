"""The scheduler benchmark runs and reports its percentiles (figures are not asserted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "scheduler.py"


def test_scheduler_bench_smoke():
    result = subprocess.run(
        [sys.executable, str(BENCH), "--smoke"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    p50_lines = [line for line in result.stdout.splitlines() if " p50 " in line]
    assert len(p50_lines) == 2, result.stdout
    assert "256 running decodes, 1024 waiting" in p50_lines[0]
    assert "1024 running decodes, 1024 waiting" in p50_lines[1]
    assert all("p90" in line and "p99" in line for line in p50_lines)
