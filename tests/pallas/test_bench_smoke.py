"""The kernel benchmark runs end to end; its byte counts and bandwidths are what its cases imply."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_kernel_bench_smoke(tmp_path):
    out_json = tmp_path / "kernels.json"
    result = subprocess.run(
        [sys.executable, "-m", "bench.kernel_timings", "--smoke", "--json", str(out_json)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr
    assert "| case | impl | tokens | median ms | CPU ms | MB moved | GB/s |" in result.stdout
    rows = json.loads(out_json.read_text())["rows"]
    attention = [r for r in rows if not r["case"].startswith("matmul")]
    assert {(r["case"], r["impl"]) for r in attention} == {
        (case, impl)
        for case in ("decode 2 x 64", "mixed 2 decodes + 1 x 8-token chunks")
        for impl in ("reference", "interpret", "xla", "native")
    }
    # Hand-counted for SmolLM2's attention (3 KV heads, 9 query heads, head_dim 64, float32):
    # K and V of every live position, plus q read and the output written, 4 bytes each.
    decode = (2 * 64 * 3 * 64 * 2 + 2 * 9 * 64 * 2) * 4  # 2 seqs x 64 positions
    mixed = ((64 + 63 + 40) * 3 * 64 * 2 + 10 * 9 * 64 * 2) * 4  # contexts 64, 63, 40; 10 tokens
    expected = {"decode 2 x 64": (2, decode), "mixed 2 decodes + 1 x 8-token chunks": (10, mixed)}
    for r in attention:
        tokens, num_bytes = expected[r["case"]]
        assert r["tokens"] == tokens and round(r["mbytes"] * 1e6) == num_bytes
    # The matmul rows: one 64x40 weight stacked over 2 layers, read once per call.
    matmuls = [r for r in rows if r["case"].startswith("matmul")]
    assert {(r["tokens"], r["impl"]) for r in matmuls} == {
        (t, i) for t in (1, 3) for i in ("xla", "native")
    }
    assert all(round(r["mbytes"] * 1e6) == 2 * 64 * 40 * 4 for r in matmuls)
    for r in rows:
        assert r["ms"] > 0 and r["cpu_ms"] > 0
        assert abs(r["gbps"] - r["mbytes"] / r["ms"]) <= 1e-9 * r["gbps"]
