"""bench.offline and bench.bucket_costs run end to end on the real model in their smoke modes.

The reports must add up: every request gets exactly the output tokens the workload asked for,
the dense decode loop reproduces the engine's greedy tokens, and the padding figures agree with
the tokens the workload fed to the model.
"""

from __future__ import annotations

import json

import pytest

from bench.workloads import SMOKE_ENGINE
from jserve.core.buckets import make_seq_buckets, make_token_buckets, step_buckets
from tests.bench.conftest import run_bench
from tests.shared_engine import SHARED


def run_smoke(module: str, *args: str) -> None:
    result = run_bench(module, "--smoke", *args, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_the_smoke_engines_are_the_shared_engines():
    """bench.offline's and bench.peer_compare's smoke engines compile no step of their own in a
    test run: theirs are the shared engine's, which the run's compilation cache holds."""
    assert SMOKE_ENGINE == SHARED


def test_offline_smoke_reports_both_policies_and_decode_rates(tmp_path):
    out = tmp_path / "offline.json"
    run_smoke("offline", "--json", str(out))
    report = json.loads(out.read_text())
    workload = report["workload"]
    assert len(workload["prompt_lens"]) == len(workload["output_lens"]) == 8
    assert all(10 <= n <= 40 for n in workload["prompt_lens"])
    assert all(4 <= n <= 16 for n in workload["output_lens"])
    assert workload["output_tokens"] == sum(workload["output_lens"])

    throughput = report["throughput"]
    for policy in ("continuous", "static"):
        run = throughput[policy]
        assert run["steps"] > 0 and run["wall_s"] > 0
        assert run["output_tok_per_s"] * run["wall_s"] == pytest.approx(workload["output_tokens"])
        total = workload["output_tokens"] + workload["prompt_tokens"]
        assert run["total_tok_per_s"] * run["wall_s"] == pytest.approx(total)
    ratio = throughput["continuous"]["output_tok_per_s"] / throughput["static"]["output_tok_per_s"]
    assert throughput["ratio_wall"] == pytest.approx(ratio)

    decode = report["decode"]
    assert decode["dense_matches_engine"], (decode["dense_tokens"], decode["engine_tokens"])
    assert [row["batch"] for row in decode["rows"]] == [1, 4]
    for row in decode["rows"]:
        for side in ("engine", "dense"):
            rate = row[side]
            assert rate["steps"] == 3
            assert rate["tok_per_s"] == pytest.approx(1e3 * row["batch"] / rate["step_ms"])
        ratio = row["dense_over_engine"]  # each alternated pair's engine step / dense step
        assert ratio["n"] == ratio["of"] == 3
        assert ratio["min"] <= ratio["median"] <= ratio["max"]


def test_buckets_smoke_times_every_bucket_and_counts_padding(tmp_path):
    prefix = tmp_path / "buckets_smoke"
    run_smoke("bucket_costs", "--out", str(prefix))
    report = json.loads(prefix.with_suffix(".json").read_text())
    assert report["compile"]["fresh_cache"] is True
    # The smoke engine: 4 sequences, 16 tokens per step; token buckets start at 1.
    expected = step_buckets(make_token_buckets(16, smallest=1), make_seq_buckets(4))
    assert [(r["T"], r["S"]) for r in report["buckets"]] == expected
    for row in report["buckets"]:
        assert row["compile_s"] > 0
        expected_tokens = {
            "decode": min(row["S"], row["T"]),
            "prefill": row["T"],
            "mixed": row["T"],
        }
        for kind, tokens in expected_tokens.items():
            assert row[kind]["tokens"] == tokens
            assert row[kind]["tok_per_s"] == pytest.approx(1e3 * tokens / row[kind]["step_ms"])
            assert row[kind]["cpu_ms"] > 0

    w = report["workload"]
    # No preemption or prefix hits at this size: every prompt token and every fed-back output
    # token (all but each request's last) is computed exactly once.
    assert w["real_tokens"] == w["prompt_tokens"] + w["output_tokens"] - w["num_requests"]
    assert w["computed_tokens"] == sum(b["computed"] for b in w["by_bucket"])
    assert w["padding_share"] == pytest.approx(1 - w["real_tokens"] / w["computed_tokens"])
    assert 0 < w["padding_share"] < 1
    assert sum(b["steps"] for b in w["by_bucket"]) == w["steps"] == sum(w["steps_by_kind"].values())
    assert sum(b["time_share"] for b in w["by_bucket"]) == pytest.approx(1)
    assert 0 < w["runner_s"] < w["wall_s"] == pytest.approx(sum(w["wall_s_by_kind"].values()))

    assert "| 16 | 4 |" in prefix.with_suffix(".md").read_text()
    png = prefix.with_suffix(".png")
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 300_000
