"""The serving benchmarks' smoke modes run end to end against mock servers on loopback.

The mock tokenizes one character per token and honours min_tokens, so the exact prompt and
output lengths the workload asked for must come back in every request's usage.
"""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from bench.workloads import SERVE_SMOKE
from jserve.simulate.workload import LengthDist
from tests.bench.conftest import run_bench


def run_script(module: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return run_bench(module, *args, "--no-progress", timeout=timeout)


def test_serve_smoke_measures_exactly_the_workload(mock_server, tmp_path):
    slo = ["--slo-ttft", "10000", "--slo-tpot", "10000"]
    result = run_script(
        "serve", "--base-url", mock_server.base_url, "--smoke", "--out", str(tmp_path), *slo
    )
    assert result.returncode == 0, result.stderr
    assert "Output token throughput" in result.stdout
    report = json.loads((tmp_path / "serve.json").read_text())
    summary, rows = report["summary"], report["requests"]

    rng = np.random.default_rng(0)  # build_workload draws prompt lengths, then output lengths
    prompt_lens = LengthDist.parse(SERVE_SMOKE["prompt_len"]).sample(rng, 8)
    output_lens = LengthDist.parse(SERVE_SMOKE["output_len"]).sample(rng, 8)
    assert [r["prompt_tokens"] for r in rows] == prompt_lens
    assert [r["output_tokens"] for r in rows] == output_lens
    assert report["workload"]["exact_token_lengths"] is True

    assert (summary["completed"], summary["failed"], summary["output_len_mismatches"]) == (8, 0, 0)
    assert summary["output_tokens"] == sum(output_lens)
    assert summary["output_throughput"] * summary["duration_s"] == pytest.approx(sum(output_lens))
    assert summary["goodput"] == summary["request_throughput"]  # generous SLOs: all count
    for row in rows:  # the mock streams one token per chunk
        assert row["num_chunks"] == row["output_tokens"]
        assert 0 < row["ttft"] <= row["e2e"]
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        assert 0 < stats["p50"] <= stats["p90"] <= stats["p99"] <= stats["max"], key
    png = tmp_path / "serve.png"
    assert png.read_bytes()[:4] == b"\x89PNG" and png.stat().st_size < 300_000


def test_serve_counts_refused_requests_instead_of_crashing(mock_server, tmp_path):
    dataset = tmp_path / "requests.jsonl"
    lines = [{"prompt": "hello there", "max_tokens": 5},
             {"prompt": "far too long for the mock", "max_tokens": 10_000}]  # fmt: skip
    dataset.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    result = run_script("serve", "--base-url", mock_server.base_url,
                        "--dataset", str(dataset), "--out", str(tmp_path))  # fmt: skip
    assert result.returncode == 0, result.stderr
    summary = json.loads((tmp_path / "serve.json").read_text())["summary"]
    assert (summary["completed"], summary["failed"]) == (1, 1)
    assert summary["failure_reasons"] == {"HTTP 400": 1}
    assert summary["output_tokens"] == 5


def test_serve_reports_an_unreachable_server(tmp_path):
    result = run_script("serve", "--base-url", "http://127.0.0.1:9", "--smoke", timeout=60)
    assert result.returncode == 2
    assert "bench.serve: error:" in result.stderr and "Traceback" not in result.stderr


def test_compare_smoke_runs_every_preset_and_the_load_curve(tmp_path):
    result = run_script("serve_compare", "all", "--smoke", "--out", str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    for preset in ("static-vs-continuous", "prefix-cache", "chunked-prefill"):
        report = json.loads((tmp_path / f"serve_{preset}.json").read_text())
        a, b = report["sides"]["a"], report["sides"]["b"]
        for side in (a, b):
            summary = report["reports"][side]["summary"]
            assert summary["completed"] > 0 and summary["failed"] == 0, (preset, side)
            # CPU time has 10 ms ticks: a short mock run may not reach one, so only >= 0.
            assert summary["engine_steps"] > 0 and summary["server_cpu_ms_per_token"] >= 0
            assert (tmp_path / f"serve_{preset}_{side}.png").stat().st_size < 300_000
        # Smoke side B is a mock twice as fast as side A: its throughput must come out ahead.
        throughput = next(r for r in report["table"] if r["metric"] == "output tokens/s")
        assert throughput["gain"] > 1.2, (preset, throughput)
        assert report["headline"]["gain"] is not None
    groups = json.loads((tmp_path / "serve_chunked-prefill.json").read_text())["reports"]
    assert set(groups["chunked-prefill"]["groups"]) == {"decode", "prefill"}
    curve = json.loads((tmp_path / "serve_latency_vs_load.json").read_text())
    assert [p["rate"] for p in curve["points"]] == [16, 64, "inf"]
    assert all(p["failed"] == 0 and p["ttft_p99_ms"] > 0 for p in curve["points"])
    assert (tmp_path / "serve_latency_vs_load.png").stat().st_size < 300_000


@pytest.mark.skipif(
    not (shutil.which("smg") and shutil.which("vllm-router")),
    reason="the routers are not installed (jserve[fleet])",
)
def test_router_smoke_runs_every_policy_and_a_fault_that_nothing_hangs_on(tmp_path):
    result = run_script("serve_compare", "router", "--smoke", "--out", str(tmp_path), timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((tmp_path / "serve_router.json").read_text())
    assert report["policies"] == ["round_robin", "cache_aware", "kv_aware"]
    for policy in report["policies"]:
        summary = report["reports"][policy]["summary"]
        assert (summary["completed"], summary["failed"]) == (12, 0), policy
        assert report["reports"][policy]["prefix_cache_hit_rate"] is None  # the mock: no cache
    fault = report["fault"]
    assert fault["hung"] == 0 and fault["served"] + fault["failed"] == fault["sent"] == 12
    assert fault["failed_after_detection"] == 0
    assert fault["served"] >= 4  # the surviving replica finishes the rest
    assert "fault (cache_aware, one replica SIGKILLed" in result.stdout
