"""The serving benchmark's arithmetic on hand-made inputs: lengths, arrivals, stats, knee, gain."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
from compare import gain, shares_while_all_wait
from load_curve import find_knee, parse_rates
from serve import to_json
from serve_client import RequestRecord, send_times
from serve_metrics import summarize
from server_stats import parse_cumulative, process_tree_cpu_seconds, run_stats
from workloads import LengthDist, RequestSpec


@pytest.mark.parametrize(
    "text", ["0", "uniform:5:4", "uniform:0:4", "lognormal:64", "lognormal:0:1", "normal:1:2", "x"]
)
def test_bad_length_distributions_are_refused(text):
    with pytest.raises(ValueError, match="bad length distribution"):
        LengthDist.parse(text)


def test_length_samples_stay_in_bounds():
    rng = np.random.default_rng(1)
    assert LengthDist.parse("7").sample(rng, 3) == [7, 7, 7]
    uniform = LengthDist.parse("uniform:3:5").sample(rng, 500)
    assert set(uniform) == {3, 4, 5}
    lognormal = LengthDist.parse("lognormal:40:1.5:100").sample(rng, 2000)
    assert min(lognormal) >= 1 and max(lognormal) == 100  # the cap is hit with sigma 1.5
    assert 30 <= float(np.median(lognormal)) <= 50


def test_send_times_poisson_rate_and_fixed_arrivals():
    specs = [RequestSpec("p", 1)] * 4000
    times = send_times(specs, rate=5.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert np.mean(np.diff(times)) == pytest.approx(0.2, rel=0.05)
    assert send_times(specs[:3], rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]
    fixed = [RequestSpec("p", 1, arrival_s=2.5), RequestSpec("p", 1)]
    assert send_times(fixed, rate=float("inf"), seed=0) == [2.5, 0.0]


def record(index, start, chunk_times, *, output_tokens=None, error=""):
    r = RequestRecord(index, "all", len(chunk_times), success=not error, error=error, start=start)
    if not error:
        r.chunk_times, r.chunk_tokens = chunk_times, [1] * len(chunk_times)
        r.ttft, r.e2e = chunk_times[0] - start, chunk_times[-1] - start
        r.prompt_tokens, r.output_tokens = 10, output_tokens or len(chunk_times)
    return r


def test_summary_figures_by_hand():
    records = [
        record(0, 0.0, [0.1, 0.2, 0.3]),  # TTFT 100 ms, TPOT 100 ms, ITL 100, 100
        record(1, 1.0, [1.5, 1.6, 1.9]),  # TTFT 500 ms, TPOT 200 ms, ITL 100, 300
        record(2, 2.0, [], error="HTTP 400: too long"),
    ]
    s = summarize(records, duration=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (s["completed"], s["failed"], s["failure_reasons"]) == (2, 1, {"HTTP 400": 1})
    assert (s["prompt_tokens"], s["output_tokens"]) == (20, 6)
    assert s["request_throughput"] == 1.0 and s["output_throughput"] == 3.0
    assert s["total_token_throughput"] == 13.0
    assert s["ttft_ms"]["mean"] == pytest.approx(300) and s["ttft_ms"]["max"] == pytest.approx(500)
    assert s["tpot_ms"]["p50"] == pytest.approx(150)
    assert s["itl_ms"]["p50"] == pytest.approx(100) and s["itl_ms"]["max"] == pytest.approx(300)
    assert s["e2e_ms"]["mean"] == pytest.approx(600)
    assert s["goodput"] == 0.5 and s["goodput_fraction"] == pytest.approx(1 / 3)  # only #0
    assert summarize(records[2:], 1.0)["ttft_ms"]["p99"] is None


def test_knee_is_the_highest_rate_within_twice_the_lowest_p99_ttft():
    def point(rate, ttft):
        return {"rate": rate, "achieved_rps": 0.0, "ttft_p99_ms": ttft}

    rising = [point(1, 100), point(2, 150), point(4, 250), point(8, 900)]
    assert find_knee(rising) == 2  # 250 > 2 x 100
    noisy_start = [point(0.5, 700), point(1, 400), point(2, 550), point(float("inf"), 6000)]
    assert find_knee(noisy_start) == 2  # 0.5 req/s ran slow; the lowest p99 (400) sets the bar
    assert find_knee([point(1, 100), point(float("inf"), 190)]) == float("inf")
    assert find_knee([point(1, None), point(2, 100)]) == 2  # nothing finished at 1 req/s
    assert find_knee([point(1, None)]) is None


def test_rates_and_gain_and_strict_json():
    assert parse_rates("0.5,1,inf") == [0.5, 1.0, float("inf")]
    for bad in ("2,1", "0,1", "a"):
        with pytest.raises(ValueError, match="--rates"):
            parse_rates(bad)
    assert gain(100.0, 250.0, higher_is_better=True) == 2.5
    assert gain(300.0, 100.0, higher_is_better=False) == 3.0
    assert gain(None, 1.0, higher_is_better=True) is None
    assert (
        to_json({"rate": float("inf"), "x": [1.5]}) == '{\n "rate": "inf",\n "x": [\n  1.5\n ]\n}\n'
    )


def test_server_stats_from_prometheus_text():
    before = parse_cumulative(
        "# HELP vllm:iteration_tokens_total Tokens per step.\n"
        'vllm:iteration_tokens_total_count{engine="0",model_name="m"} 10.0\n'
        'vllm:iteration_tokens_total_sum{engine="0",model_name="m"} 100.0\n'
        'vllm:iteration_tokens_total_bucket{engine="0",le="1.0"} 3.0\n'
        'vllm:request_success_total{finished_reason="length"} 2.0\n'
        'vllm:request_success_total{finished_reason="stop"} 1.0\n'
        "vllm:num_requests_running 4.0\n"
        "python_gc_objects_collected_total 99.0\n"
    )
    assert before == {
        "vllm:iteration_tokens_total_count": 10.0,
        "vllm:iteration_tokens_total_sum": 100.0,
        "vllm:request_success_total": 3.0,
    }
    after = {**before, "vllm:iteration_tokens_total_count": 50.0,
             "vllm:iteration_tokens_total_sum": 900.0}  # fmt: skip
    stats = run_stats(before, after, duration=2.0)
    assert stats["engine_steps"] == 40 and stats["tokens_per_step"] == 20.0
    assert stats["wall_ms_per_step"] == 50.0
    assert stats["deltas"] == {"vllm:iteration_tokens_total_count": 40.0,
                               "vllm:iteration_tokens_total_sum": 800.0}  # fmt: skip
    assert "engine_steps" not in run_stats({}, {}, 1.0)


def test_cpu_seconds_cover_the_whole_process_tree():
    # A shell whose child burns about 0.6 s of CPU: the child's time must count for the parent.
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n"
    shell = subprocess.Popen(["/bin/sh", "-c", f'{sys.executable} -c "{burn}"; sleep 30'])
    try:
        deadline = time.monotonic() + 20
        while process_tree_cpu_seconds(shell.pid) < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert 0.5 <= process_tree_cpu_seconds(shell.pid) < 5
    finally:
        shell.kill()
        shell.wait()
    with pytest.raises(ValueError, match="--server-pid"):
        process_tree_cpu_seconds(shell.pid)


def test_token_shares_count_only_while_every_group_waits():
    def record(group, start, ttft, prompt, chunk_times):
        return RequestRecord(
            index=0, group=group, expected_output_tokens=len(chunk_times), success=True,
            start=start, ttft=ttft, e2e=chunk_times[-1] - start, prompt_tokens=prompt,
            output_tokens=len(chunk_times), chunk_times=chunk_times,
            chunk_tokens=[1] * len(chunk_times),
        )  # fmt: skip

    # A waits over [0, 4), B over [1, 3): the one window is [1, 3]. Inside it A's first
    # request gets its 10 prompt tokens and first output token at 2 and one more at 2.5 (its
    # token at 5 and the second request's, from 4 on, are outside); B's gets its 4 prompt
    # tokens and first output token at 3 (its second, at 3.5, is outside).
    records = [
        record("A", 0.0, 2.0, 10, [2.0, 2.5, 5.0]),
        record("A", 0.5, 3.5, 7, [4.0, 6.0]),
        record("B", 1.0, 2.0, 4, [3.0, 3.5]),
    ]
    shares = shares_while_all_wait(records)
    assert shares == pytest.approx({"A": 12 / 17, "B": 5 / 17})
    assert shares_while_all_wait(records[:2]) is None  # one group
