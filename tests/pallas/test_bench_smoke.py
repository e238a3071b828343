"""The kernel benchmark runs end to end and prints its table (figures are not asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "kernels.py"


def test_kernel_bench_smoke(tmp_path):
    out_json = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, str(BENCH), "--smoke", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert "| case | impl | tokens | median ms | CPU ms | MB moved | GB/s |" in result.stdout
    rows = json.loads(out_json.read_text())["rows"]
    assert {(r["case"], r["impl"]) for r in rows} == {
        (case, impl)
        for case in ("decode 2 x 64", "mixed 2 decodes + 1 x 8-token chunks")
        for impl in ("reference", "interpret", "xla")
    }
    assert all(r["ms"] > 0 and r["cpu_ms"] > 0 and r["gbps"] > 0 for r in rows)
