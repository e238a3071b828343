"""The capacity simulator: virtual time priced by the cost model, figures checked by hand."""

from __future__ import annotations

import json

import pytest
import simulate
from simulate import MeasuredCost, RooflineCost, SimRequest, load_jsonl

from jserve.config.scheduler import SchedulerConfig
from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.core.step_costs import StepCosts


def flat_costs(seconds: float = 0.1) -> StepCosts:
    buckets = (1, 2, 4, 8, 16, 32)
    return StepCosts(buckets, (8,), {(t, t if t < 8 else 8): seconds for t in buckets})


def test_one_request_takes_its_steps_at_the_table_price():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256)
    workload = [SimRequest(0.0, 20, 5), SimRequest(0.05, 10, 3, tenant="b")]
    result = simulate.simulate(workload, config, 128, MeasuredCost(flat_costs()), None)
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
    late = simulate.simulate(workload, config, 128, MeasuredCost(flat_costs()), None)
    assert late.records[1].error == "timeout" and late.deadline_misses == 1
    early = simulate.simulate(workload, config, 128, MeasuredCost(flat_costs()), flat_costs())
    assert early.records[1].error == "rejected deadline" and early.deadline_misses == 0


def test_the_roofline_is_memory_bound_for_decodes_and_compute_bound_for_prefill():
    model = RooflineCost(overhead_s=0.0)
    weights = model.params * model.bytes_per_param / model.bandwidth

    def plan(tokens: int, seqs: int) -> StepPlan:
        per_seq = tokens // seqs
        seq = ScheduledSeq("r", 0, [0] * per_seq, [], True, (), [])
        return StepPlan(seqs=[seq] * seqs, num_batched_tokens=tokens)

    decode = model(plan(8, 8))  # 8 one-token decodes: weights plus 8 tokens of KV
    assert decode == pytest.approx(weights + 8 * model.kv_bytes_per_token / model.bandwidth)
    prefill = model(plan(4096, 1))
    assert prefill == pytest.approx(2 * model.params * 4096 / model.peak_flops)


def test_jsonl_workloads_load_and_bad_lines_say_where(tmp_path):
    path = tmp_path / "w.jsonl"
    row = {"arrival_s": 0.5, "prompt_tokens": 12, "max_tokens": 4, "tenant": "a", "timeout": 2}
    path.write_text(json.dumps(row) + "\n\n" + json.dumps({"arrival_s": 1}) + "\n")
    with pytest.raises(ValueError, match=r"w.jsonl:3: KeyError"):
        load_jsonl(str(path))
    path.write_text(json.dumps(row) + "\n")
    assert load_jsonl(str(path)) == [SimRequest(0.5, 12, 4, "a", "interactive", 2.0)]


def test_fairness_preset_gives_the_light_tenant_its_share(capsys):
    args = simulate.build_parser().parse_args(["--num-requests", "120"])
    text = simulate.preset_fairness(args)
    vtc_rows = [line.split() for line in text.splitlines() if line.strip().startswith("vtc")]
    assert len(vtc_rows) == 2
    for row in vtc_rows:
        assert float(row[1].rstrip("%")) >= 45.0  # B's share while both are backlogged
