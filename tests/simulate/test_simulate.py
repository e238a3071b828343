"""The capacity simulator: virtual time priced by the cost model, figures checked by hand (the
serving figures it shares with the serving benchmark too), and the `jserve simulate` command."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import numpy as np
import pytest

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.core.step_costs import StepCosts
from jserve.server.cli import main as jserve
from jserve.simulate.costs import MeasuredCost
from jserve.simulate.metrics import RequestRecord, summarize
from jserve.simulate.simulator import simulate
from jserve.simulate.versus_measured import compare_serve, served_config
from jserve.simulate.workload import LengthDist, SimRequest, load_jsonl, parse_tenant_shares

RESULTS = Path(__file__).resolve().parents[2] / "bench" / "results"


def flat_costs(seconds: float = 0.1) -> StepCosts:
    buckets = (1, 2, 4, 8, 16, 32)
    return StepCosts(buckets, (8,), {(t, t if t < 8 else 8): seconds for t in buckets})


def test_one_request_takes_its_steps_at_the_table_price():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    workload = [SimRequest(0.0, 20, 5), SimRequest(0.05, 10, 3, tenant="b")]
    result = simulate(workload, config, 128, MeasuredCost(flat_costs()), None)
    first, second = result.records
    # Step 1: a's prompt and first token; b arrives at 0.05, joins at t=0.1 and, being 10
    # tokens, is prefilled with a's second decode.
    assert first.success and first.output_tokens == 5 and first.ttft == pytest.approx(0.1)
    assert first.e2e == pytest.approx(0.5) and first.itl == pytest.approx([0.1] * 4)
    assert second.success and second.ttft == pytest.approx(0.15)  # 0.2 - 0.05
    assert result.steps == 5 and result.duration == pytest.approx(0.5)
    assert result.served == {"default": 20 + 4, "b": 10 + 2}


def test_deadlines_expire_or_are_refused_in_virtual_time():
    config = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, max_model_len=256)
    workload = [SimRequest(0.0, 8, 10), SimRequest(0.0, 8, 10, timeout=0.5)]
    late = simulate(workload, config, 128, MeasuredCost(flat_costs()), None)
    assert late.records[1].error == "timeout" and late.deadline_misses == 1
    early = simulate(workload, config, 128, MeasuredCost(flat_costs()), flat_costs())
    assert early.records[1].error == "rejected deadline" and early.deadline_misses == 0


def test_jsonl_workloads_load_and_bad_lines_say_where(tmp_path):
    path = tmp_path / "w.jsonl"
    row = {"arrival_s": 0.5, "prompt_tokens": 12, "max_tokens": 4, "tenant": "a", "timeout": 2}
    path.write_text(json.dumps(row) + "\n\n" + json.dumps({"arrival_s": 1}) + "\n")
    with pytest.raises(ValueError, match=r"w.jsonl:3: KeyError"):
        load_jsonl(str(path))
    path.write_text(json.dumps(row) + "\n")
    assert load_jsonl(str(path)) == [SimRequest(0.5, 12, 4, "a", "interactive", 2.0)]


def test_fairness_preset_gives_the_light_tenant_its_share(capsys):
    report = str(RESULTS / "buckets_cpu.json")
    args = ["simulate", "--preset", "fairness", "--num-requests", "120", "--bucket-report", report]
    assert jserve(args) == 0
    text = capsys.readouterr().out
    vtc_rows = [line.split() for line in text.splitlines() if line.strip().startswith("vtc")]
    assert len(vtc_rows) == 2 and text.count("[simulated]") == 2  # both cost models
    for row in vtc_rows:
        assert float(row[1].rstrip("%")) >= 45.0  # B's share while both are backlogged


@pytest.mark.parametrize(
    "args, message",
    [
        (["--bucket-report", "/no/such/table.json"], "no step-cost table at /no/such/table.json"),
        (["--tenants", "A:x"], "bad tenant share 'A:x'"),
        (["--rate", "0"], "request rate must be > 0"),
        (["--prompt-len", "uniform:9:3"], "bad length distribution"),
        (["--compile-report", "/no/such.json"], "/no/such.json is not a `jserve compile"),
    ],
)
def test_bad_arguments_exit_2_with_one_line_that_says_what_to_fix(capsys, args, message):
    assert jserve(["simulate", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("jserve: error: ") and message in err and "Traceback" not in err


def test_tenant_shares_parse_with_a_default_share_of_one():
    assert parse_tenant_shares("A:4,B") == {"A": 4.0, "B": 1.0}


def test_a_serve_command_line_configures_the_scheduler_as_the_engine_would():
    command = shlex.join(["python", "-m", "jserve.server.cli", "serve", "--host", "127.0.0.1",
                          "--port", "0", "--max-num-seqs", "16", "--scheduling", "static",
                          "--save-step-costs", "costs.json", "--block-size", "32"])  # fmt: skip
    config, blocks, block_size = served_config(command)
    expected = EngineArgs(max_num_seqs=16, scheduling="static", block_size=32)
    assert config == expected.scheduler_config(expected.max_model_len or 2048)
    assert block_size == 32 and blocks == expected.kv_cache_memory // (30 * 3 * 64 * 2 * 4 * 32)
    with pytest.raises(ValueError, match="not a `jserve serve` command line"):
        served_config("python -m bench.serve --base-url x")


def test_a_measured_run_is_predicted_within_a_quarter_of_its_throughput():
    # RESULTS.md: the simulator came within 1.01-1.15x of these runs' throughputs.
    text = compare_serve(str(RESULTS / "serve_chunked-prefill.json"),
                         str(RESULTS / "buckets_cpu.json"))  # fmt: skip
    ratios = [line.split() for line in text.splitlines() if "sim/measured" in line]
    assert len(ratios) == 2  # both sides of the preset
    for row in ratios:
        throughput = float(row[row.index("sim/measured") + 1])
        assert 0.75 <= throughput <= 1.25, row


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
