"""bench.peer_compare's jserve-only smoke mode: every workload generates exactly what it asked
for."""

from __future__ import annotations

import json

from bench.peer_compare import rounds_table
from bench.workloads import FIRST_TEXT_ID, VOCAB_SIZE
from tests.bench.conftest import run_bench


def test_peer_smoke_runs_every_workload_exactly(tmp_path):
    result = run_bench("peer_compare", "--smoke", "--out", str(tmp_path))
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


def test_rounds_table_gives_each_rounds_ratio_and_their_median():
    def row(round_, workload, jserve_s, vllm_s, quiet=True):
        r = {"round": round_, "workload": workload, "jserve": {"wall_s": jserve_s},
             "vllm": {"wall_s": vllm_s}}  # fmt: skip
        return {**r, "ratio": vllm_s / jserve_s} if quiet else r

    rows = [
        row(1, "random", 50.0, 60.0), row(1, "batch-1", 3.0, 4.0),
        row(2, "random", 50.0, 45.0), row(2, "batch-1", 3.0, 3.0, quiet=False),
        row(3, "random", 40.0, 50.0), row(3, "batch-1", 3.0, 3.3),
    ]  # fmt: skip
    lines = rounds_table(rows).splitlines()
    random, batch = lines[2].split(" | "), lines[3].split(" | ")
    assert random[0] == "| random" and random[1] == "1.20, 0.90, 1.25"
    assert random[2] == "**1.20x** (3 of 3)"  # the median, not the mean
    assert random[3] == "0.90 / 1.25"  # min / max
    assert random[4:] == ["50.00, 50.00, 40.00", "60.00, 45.00, 50.00 |"]
    assert batch[1] == "1.33, 1.10" and batch[2] == "**1.22x** (2 of 3)"  # a loud round left out
    assert batch[3] == "1.10 / 1.33"
