"""bench/peer.py's jserve-only smoke mode: every workload generates exactly what it asked for."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from peer import FIRST_TEXT_ID, VOCAB_SIZE

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"


def test_peer_smoke_runs_every_workload_exactly(tmp_path):
    result = subprocess.run(
        [sys.executable, str(BENCH_DIR / "peer.py"), "--smoke", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    runs = json.loads((tmp_path / "peer_jserve.json").read_text())["runs"]
    assert [r["workload"] for r in runs] == ["random", "shared-prefix", "batch-1"]
    for run in runs:
        workload = json.loads((tmp_path / f"peer_workload_{run['workload']}.json").read_text())
        requests = workload["requests"]
        ids = [t for r in requests for t in r["prompt_token_ids"]]
        assert min(ids) >= FIRST_TEXT_ID and max(ids) < VOCAB_SIZE
        # EOS is ignored, so every request generates exactly its max_tokens.
        assert run["output_tokens"] == sum(r["max_tokens"] for r in requests)
        assert run["prompt_tokens"] == len(ids)
        assert [len(f) for f in run["first_ids"]] == [min(16, r["max_tokens"]) for r in requests]
        assert run["cpu_s"] > 0
    shared = json.loads((tmp_path / "peer_workload_shared-prefix.json").read_text())["requests"]
    prefix = shared[0]["prompt_token_ids"][:48]
    assert all(r["prompt_token_ids"][:48] == prefix for r in shared)
    report = json.loads((tmp_path / "peer.json").read_text())
    assert [row["workload"] for row in report["offline"]] == ["random", "shared-prefix", "batch-1"]
    assert report["offline"][2]["jserve"]["ms_per_output_token"] > 0
    assert "| batch-1 |" in result.stdout
