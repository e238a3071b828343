"""The benchmarks' arithmetic on hand-made inputs: arrivals, knee, gain, JSON, Prometheus text,
CPU seconds, token shares; the report writer's tables and the A/B driver's alternation."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest

from bench.ab_driver import alternate, describe, ratio_stats
from bench.load_curve import find_knee, parse_rates
from bench.report_writer import markdown_table, text_table, to_json
from bench.serve_client import send_times
from bench.serve_compare import gain, shares_while_all_wait
from bench.server_stats import parse_cumulative, process_tree_cpu_seconds, run_stats
from bench.workloads import RequestSpec
from jserve.simulate.metrics import RequestRecord


def test_send_times_poisson_rate_and_fixed_arrivals():
    specs = [RequestSpec("p", 1)] * 4000
    times = send_times(specs, rate=5.0, seed=0)
    assert times[0] == 0.0 and times == sorted(times)
    assert np.mean(np.diff(times)) == pytest.approx(0.2, rel=0.05)
    assert send_times(specs[:3], rate=float("inf"), seed=0) == [0.0, 0.0, 0.0]
    fixed = [RequestSpec("p", 1, arrival_s=2.5), RequestSpec("p", 1)]
    assert send_times(fixed, rate=float("inf"), seed=0) == [2.5, 0.0]


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


def test_markdown_and_text_tables_lay_out_the_cells_they_are_given():
    table = markdown_table(["case", "ms"], [["decode", "1.50"], ["prefill", "12.00"]], "lr")
    assert table.splitlines() == ["| case | ms |", "|---|---:|", "| decode | 1.50 |",
                                  "| prefill | 12.00 |"]  # fmt: skip
    with pytest.raises(ValueError, match="2 columns"):
        markdown_table(["case", "ms"], [["decode"]])
    text = text_table([["metric", "a"], ["TTFT p50 (ms)", "9.5"]], align="lr", rule=True)
    assert text.splitlines() == ["metric           a", "-------------  ---",
                                 "TTFT p50 (ms)  9.5"]  # fmt: skip


def test_the_ab_driver_alternates_pair_by_pair_and_reports_each_pairs_ratio():
    calls = []

    def side(name: str, values: list[float]):
        return lambda: calls.append(name) or values[sum(c == name for c in calls) - 1]

    run = alternate(side("A", [2.0, 4.0, 3.0]), side("B", [1.0, 1.0, 2.0]), 3)
    assert calls == ["A", "B"] * 3 and run.a == [2.0, 4.0, 3.0] and run.b == [1.0, 1.0, 2.0]
    summary = run.summary(lambda a, b: a / b)
    assert summary["ratio"] == {"ratios": [2.0, 4.0, 1.5], "n": 3, "of": 3, "min": 1.5,
                                "median": 2.0, "max": 4.0}  # fmt: skip
    assert summary["pairs"] == 3 and summary["order"] == "AB"
    assert set(summary["loadavg_1min"]) == {"before", "after"}
    calls.clear()
    alternate(side("A", [1.0] * 4), side("B", [1.0] * 4), 4, abba=True)
    assert calls == ["A", "B", "B", "A", "A", "B", "B", "A"]
    left = [3]  # a predicate: pairs while work is left
    run = alternate(lambda: left.__setitem__(0, left[0] - 1), lambda: None, lambda: left[0] > 0)
    assert len(run.a) == 3
    with pytest.raises(ValueError, match="at least one pair"):
        alternate(lambda: 1, lambda: 1, 0)


def test_ratio_stats_leave_out_pairs_without_a_ratio():
    stats = ratio_stats([1.2, None, 0.9, 1.25])
    assert (stats["n"], stats["of"], stats["min"], stats["median"], stats["max"]) == (
        3, 4, 0.9, 1.2, 1.25,
    )  # fmt: skip
    assert describe(stats) == "1.20x (0.90-1.25, 3 of 4 pairs)"
    assert describe(ratio_stats([None])) == "- (0 of 1 pairs)"
