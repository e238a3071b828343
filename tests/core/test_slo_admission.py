"""Deadline-aware admission, the KV reject watermark, step costs and the adaptive budget."""

from __future__ import annotations

import json

import pytest

from jserve.core.admission import estimate_finish
from jserve.core.buckets import make_seq_buckets, make_token_buckets
from jserve.core.step_costs import StepCosts, learned_report, load_bucket_report
from jserve.errors import RequestRejected

from .helpers import make_request, make_scheduler, run_until_idle, step, tracked

TOKEN_BUCKETS = make_token_buckets(32, smallest=1)  # 1, 2, 4, 8, 16, 32
SEQ_BUCKETS = make_seq_buckets(8)  # 8


def linear_costs(per_token: float = 0.01, fixed: float = 0.05) -> StepCosts:
    """A step of T tokens takes fixed + T * per_token seconds (every bucket measured)."""
    seed = {(t, s): fixed + t * per_token for t in TOKEN_BUCKETS for s in (t if t < 8 else 8,)}
    return StepCosts(TOKEN_BUCKETS, SEQ_BUCKETS, seed)


def test_step_costs_learn_online_and_price_unmeasured_buckets():
    costs = StepCosts(TOKEN_BUCKETS, SEQ_BUCKETS)
    assert costs.cost(5, 1) is None
    costs.observe(5, 1, 1.0)  # bucket (8, 8)
    assert costs.cost(7, 3) == 1.0
    costs.observe(6, 2, 2.0)
    assert costs.cost(8, 8) == pytest.approx(1.2)  # moving average, weight 0.2
    assert costs.cost(32, 8) == pytest.approx(1.2 * 4)  # nearest, scaled by tokens
    assert costs.recent == pytest.approx(1.0 + 0.05 * (2.0 - 1.0))  # every bucket's steps
    # A latency target prices the tail: the mean plus 2.5 moving mean absolute deviations.
    assert costs.latency(8, 8) == pytest.approx(1.2 + 2.5 * 0.2 * 1.0)
    assert costs.latency(32, 8) == pytest.approx(4 * (1.2 + 2.5 * 0.2))  # borrowed, scaled
    assert costs.largest_within(1.75, 1) == 8
    assert costs.largest_within(1.65, 1) is None


def test_the_time_between_steps_counts_against_the_itl_target():
    costs = linear_costs(per_token=0.01, fixed=0.05)  # 16 tokens: 0.21 s, 8: 0.13 s
    scheduler = make_scheduler(step_costs=costs, target_itl_ms=250.0)
    assert scheduler.step_budget() == 16
    for _ in range(200):  # the engine spends 50 ms between steps
        costs.observe_between_steps(0.05)
    assert costs.between_steps == pytest.approx(0.05, rel=1e-3)
    assert scheduler.step_budget() == 8  # 0.21 + 0.05 > 0.25 >= 0.13 + 0.05


def test_a_deadline_that_cannot_be_met_is_refused_with_the_numbers():
    scheduler = make_scheduler(step_costs=linear_costs(), max_num_seqs=8)
    # Alone: 8 prompt tokens in one 32-token step (0.37 s) + 4 decode steps of 1 seq (0.06 s).
    scheduler.add_request(make_request("ok", 8, max_tokens=4, deadline=1.0), now=0.0)
    with pytest.raises(RequestRejected) as info:
        scheduler.add_request(make_request("late", 8, max_tokens=40, deadline=0.5), now=0.0)
    assert info.value.reason == "deadline"
    assert "estimated to take" in str(info.value) and "leaves 0.50 s" in str(info.value)
    assert info.value.retry_after >= 1.0
    assert tracked(scheduler, "late") is None
    # No deadline, no check; work ahead makes a later request's estimate longer.
    for i in range(6):
        scheduler.add_request(make_request(f"bulk{i}", 30, max_tokens=4))
    with pytest.raises(RequestRejected, match="deadline cannot be met"):
        scheduler.add_request(make_request("behind", 8, max_tokens=4, deadline=1.0), now=0.0)
    # A lower lane's queue is not ahead of an interactive request.
    scheduler.add_request(make_request("batch", 8, max_tokens=4, lane="batch"))
    run_until_idle(scheduler)


def _estimate(scheduler, costs: StepCosts, new) -> float:
    result = estimate_finish(new, scheduler.config, costs, scheduler.running,
                             scheduler.waiting, scheduler.step_budget())  # fmt: skip
    assert result is not None
    return result.total


def test_lower_lanes_fill_a_deadline_requests_steps_only_while_a_slot_is_free():
    """Batch work waiting behind an interactive request shares its decode steps only if it
    can be admitted, and then only as many steps as its prompt's chunks fill."""
    costs = linear_costs(per_token=0.01, fixed=0.05)

    def estimate(num_running: int) -> float:
        # (No aging in the window: a promoted batch request would count as ahead.)
        scheduler = make_scheduler(step_costs=costs, max_num_seqs=4, aging_iterations=10**6)
        for i in range(num_running):
            scheduler.add_request(make_request(f"run{i}", 4, 100 * i, max_tokens=50))
        step(scheduler)  # admit them (their prompts fit one step)
        scheduler.add_request(make_request("batch", 30, 5000, max_tokens=20, lane="batch"))
        return _estimate(scheduler, costs, make_request("new", 4, 6000, max_tokens=10))

    full, decode = 0.37, 0.09  # a 32-token step; a step of 4 decodes
    own_prefill = 4 / 32 * full
    # Each lower lane is assumed to put one request ahead by aging: its 30-token prompt is
    # prefilled in full steps first, and it takes a slot for its 20 decodes. With 3 running
    # (49 decodes left each) that is the one free slot, so the new request waits until the
    # promoted one's slot frees (20 steps, the first 30/32 of them full), and its own 10
    # decodes are decode steps.
    wait = 30 / 32 * full + (20 - 30 / 32) * decode
    assert estimate(3) == pytest.approx(wait + own_prefill + 10 * decode)
    # With 2 running a slot is free for it at once; the batch prompt's 30 tokens also fill
    # the slot left over and share its decode steps: ceil(30 / (32 - 3)) = 2 of them full.
    wait = 30 / 32 * full
    assert estimate(2) == pytest.approx(wait + own_prefill + 2 * full + 8 * decode)


def test_a_deadline_request_waits_for_the_slot_its_turn_frees():
    """With every sequence slot taken, the wait is for the slot that frees in its turn: each
    request ahead takes the earliest one for its own decodes (not a mean decode per round)."""
    costs = linear_costs(per_token=0.01, fixed=0.05)
    scheduler = make_scheduler(step_costs=costs, max_num_seqs=2)
    scheduler.add_request(make_request("short", 4, 100, max_tokens=6))
    scheduler.add_request(make_request("long", 4, 200, max_tokens=21))
    step(scheduler)  # both run, one token out: 5 and 20 decodes left
    scheduler.add_request(make_request("ahead", 4, 300, max_tokens=8))
    full, decode = 0.05 + 0.32, 0.05 + 0.02  # a 32-token step; a step of 2 decodes
    # "ahead" takes the slot "short" frees after 5 steps and holds it for 8: the new request
    # gets the slot "long" frees after 13 < 20 steps. The first 4/32 of a step of that wait
    # is "ahead"'s prompt in a full step.
    wait = 4 / 32 * full + (13 - 4 / 32) * decode
    own = 4 / 32 * full + 3 * decode
    assert _estimate(scheduler, costs, make_request("new", 4, 400, max_tokens=3)) == (
        pytest.approx(wait + own)
    )
    # Decoding 10 tokens from step 13, it sees "long"'s slot free at step 20. With work
    # waiting ahead of it (an overload), a prompt as long as those ahead is assumed to take
    # that slot, and its chunk makes one of the new request's decode steps a full one.
    own = 4 / 32 * full + 1 * full + 9 * decode
    assert _estimate(scheduler, costs, make_request("new", 4, 400, max_tokens=10)) == (
        pytest.approx(wait + own)
    )


def test_admitted_deadline_requests_finish_in_time_under_the_cost_model():
    """Replayed in virtual time priced by the same costs, no admitted request times out."""
    costs = linear_costs()
    scheduler = make_scheduler(step_costs=costs, max_num_seqs=4)
    now, admitted, refused = 0.0, 0, 0
    for i in range(40):
        try:
            scheduler.add_request(
                make_request(f"r{i}", 12, 100 * i, max_tokens=6, deadline=now + 1.5,
                             arrival_time=now),
                now=now,
            )  # fmt: skip
            admitted += 1
        except RequestRejected as exc:
            assert exc.reason == "deadline"
            refused += 1
        if i % 3 == 2:  # three arrivals per step: an overload
            plan = scheduler.schedule(now)
            assert not plan.finished, f"admitted requests timed out: {plan.finished}"
            now += costs.cost(plan.num_batched_tokens, len(plan.seqs)) or 0.0
            sampled = {s.request_id: 7 for s in plan.seqs if s.sample}
            scheduler.update_from_output(plan, sampled)
    assert admitted and refused


def test_kv_usage_above_the_reject_watermark_refuses_new_requests():
    scheduler = make_scheduler(
        block_size=4, num_blocks=11, max_model_len=40, kv_reject_watermark=0.5
    )
    scheduler.add_request(make_request("big", 24, max_tokens=8))
    step(scheduler)  # 6 of 10 blocks
    with pytest.raises(RequestRejected) as info:
        scheduler.add_request(make_request("next", 4))
    assert info.value.reason == "kv_full"
    assert "60.0%, above the reject watermark 50.0%" in str(info.value)
    run_until_idle(scheduler)
    scheduler.add_request(make_request("later", 4))


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1])
def test_the_reject_watermark_must_be_in_zero_one(bad):
    with pytest.raises(
        ValueError, match=r"kv_reject_watermark must be a finite number in \(0, 1\]"
    ):
        make_scheduler(kv_reject_watermark=bad)


def test_target_itl_picks_the_largest_bucket_within_it():
    costs = linear_costs(per_token=0.01, fixed=0.05)  # 16 tokens: 0.21 s, 32: 0.37 s
    scheduler = make_scheduler(step_costs=costs, target_itl_ms=250.0)
    assert scheduler.step_budget() == 16
    scheduler.add_request(make_request("long", 100, max_tokens=2))
    plan, _ = step(scheduler)
    assert plan.num_batched_tokens == 16  # the prompt is chunked at the adaptive budget
    fixed = make_scheduler(step_costs=costs)
    assert fixed.step_budget() == 32
    run_until_idle(scheduler)


def test_bucket_reports_load_and_bad_ones_say_why(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps({"buckets": [{"T": 8, "S": 8, "mixed": {"step_ms": 120.0}}]}))
    assert load_bucket_report(str(path)) == {(8, 8): 0.12}
    path.write_text(json.dumps({"buckets": [{"T": 8}]}))
    with pytest.raises(ValueError, match=r"not a bench\.bucket_costs report"):
        load_bucket_report(str(path))


def test_a_budget_lowered_below_the_running_decodes_still_decodes_them_all():
    scheduler = make_scheduler(max_num_seqs=8, max_num_batched_tokens=32)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 4, 100 * i, max_tokens=6))
    scheduler.add_request(make_request("long", 40, 5000, max_tokens=2))
    step(scheduler)  # six prompts and the first 8 tokens of the long one
    config = scheduler.config
    scheduler.reconfigure(type(config)(**{**config.__dict__, "max_num_seqs": 2,
                                          "max_num_batched_tokens": 2}))  # fmt: skip
    plan, _ = step(scheduler)
    # One token per running request: six decodes and one more prefill token.
    assert plan.num_decodes == 6 and plan.num_batched_tokens == 7
    run_until_idle(scheduler)


def test_the_learned_table_reads_back_as_a_bucket_report(tmp_path):
    costs = StepCosts(TOKEN_BUCKETS, SEQ_BUCKETS)
    costs.observe(5, 1, 0.25)  # bucket (8, 8)
    costs.observe(20, 3, 0.5)  # bucket (32, 8)
    for _ in range(100):
        costs.observe_between_steps(0.004)
    report = learned_report(costs)
    assert report["between_steps_ms"] == pytest.approx(4.0, rel=0.01)
    path = tmp_path / "learned.json"
    path.write_text(json.dumps(report))
    assert load_bucket_report(str(path)) == {(8, 8): 0.25, (32, 8): 0.5}
