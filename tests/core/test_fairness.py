"""Fair share between tenants (virtual token counters), caps, and tenant configuration."""

from __future__ import annotations

import json

import pytest

from jserve.core.fairness import DECODE_TOKEN_COST, PREFILL_TOKEN_COST
from jserve.core.request import RequestStatus
from jserve.core.tenants import TenantLabels, TenantPolicy, load_tenant_policy

from .helpers import make_request, make_scheduler, run_until_idle, step, tracked


def admission_order(scheduler) -> list[str]:
    """Request ids in the order they first ran."""
    seen: list[str] = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler)
        seen += [s.request_id for s in plan.seqs if s.request_id not in seen]
    return seen


def flood(scheduler, heavy_count: int = 8, light_count: int = 2) -> None:
    """Tenant A's requests all arrive before B's, as when A floods the queue."""
    for i in range(heavy_count):
        scheduler.add_request(make_request(f"a{i}", 8, 1000 + 10 * i, tenant="A", max_tokens=8))
    for i in range(light_count):
        scheduler.add_request(make_request(f"b{i}", 8, 5000 + 10 * i, tenant="B", max_tokens=8))


def test_fcfs_serves_the_flood_first_and_vtc_alternates():
    fcfs = make_scheduler(max_num_seqs=1, fairness="fcfs")
    flood(fcfs)
    assert admission_order(fcfs)[-2:] == ["b0", "b1"]
    vtc = make_scheduler(max_num_seqs=1, fairness="vtc")
    flood(vtc)
    # B's first request goes second: A's counter grew while a0 ran; then they alternate.
    assert admission_order(vtc)[:5] == ["a0", "b0", "a1", "b1", "a2"]


def test_served_tokens_split_by_weight_while_both_are_backlogged():
    tenants = TenantPolicy({"A": 1.0, "B": 3.0})
    scheduler = make_scheduler(max_num_seqs=2, tenants=tenants)
    flood(scheduler, heavy_count=24, light_count=24)
    for _ in range(60):  # both stay backlogged throughout
        step(scheduler)
    assert scheduler.waiting.tenant_queues("interactive").keys() == {"A", "B"}
    level = scheduler.fair.level
    # Counters are service over weight: unweighted, B got three times A's service.
    served_a, served_b = level("interactive", "A") * 1.0, level("interactive", "B") * 3.0
    assert served_b / (served_a + served_b) == pytest.approx(0.75, abs=0.06)


def test_a_returning_tenant_is_lifted_and_cannot_bank_credit():
    scheduler = make_scheduler(max_num_seqs=1)
    for i in range(6):
        scheduler.add_request(make_request(f"a{i}", 8, tenant="A", max_tokens=4))
    for _ in range(20):
        step(scheduler)
    level_a = scheduler.fair.level("interactive", "A")
    assert level_a > 0
    scheduler.add_request(make_request("b0", 8, tenant="B", max_tokens=4))
    # B was idle: it starts level with the lowest backlogged tenant, not at zero.
    assert scheduler.fair.level("interactive", "B") == level_a


def test_counters_charge_prompt_and_output_tokens_by_weight_and_not_recompute():
    scheduler = make_scheduler(tenants=TenantPolicy({"A": 2.0}))
    request = make_request("a", 10, tenant="A", max_tokens=3)
    scheduler.add_request(request)
    step(scheduler)  # the whole prompt and the first token
    expected = (10 * PREFILL_TOKEN_COST + DECODE_TOKEN_COST) / 2.0
    assert scheduler.fair.level("interactive", "A") == expected
    request.num_computed_tokens = 0  # as after a preemption: recompute the prompt
    request.num_prompt_served = 10
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {"a": 7})
    assert scheduler.fair.level("interactive", "A") == expected + DECODE_TOKEN_COST / 2.0


def test_the_victim_is_the_most_served_tenants_latest_request():
    # 6 usable blocks of 4 tokens; A's two requests have run longer than B's one.
    scheduler = make_scheduler(block_size=4, num_blocks=7, max_model_len=24, max_num_seqs=3)
    scheduler.add_request(make_request("a0", 4, tenant="A", max_tokens=12, arrival_time=0.0))
    scheduler.add_request(make_request("a1", 4, tenant="A", max_tokens=12, arrival_time=1.0))
    for _ in range(3):
        step(scheduler)
    scheduler.add_request(make_request("b0", 4, tenant="B", max_tokens=12, arrival_time=2.0))
    preempted = []
    for _ in range(12):
        plan, _ = step(scheduler)
        preempted += plan.preempted_ids
    # FCFS would preempt b0, the latest arrival; A is the most-served tenant.
    assert preempted and preempted[0] == "a1"
    run_until_idle(scheduler)


def test_a_tenant_at_its_cap_waits_while_others_run():
    tenants = TenantPolicy({"A": 1.0}, {"A": 2})
    scheduler = make_scheduler(tenants=tenants, max_num_seqs=8)
    for i in range(5):
        scheduler.add_request(make_request(f"a{i}", 4, tenant="A", max_tokens=6))
    scheduler.add_request(make_request("b0", 4, tenant="B", max_tokens=6))
    for _ in range(8):
        step(scheduler)
        running_a = [r for r in scheduler.running if r.tenant == "A"]
        assert len(running_a) <= 2
    assert tracked(scheduler, "b0") is None or tracked(scheduler, "b0").status is (
        RequestStatus.RUNNING
    )
    run_until_idle(scheduler)


def test_tenants_file_is_validated(tmp_path):
    path = tmp_path / "tenants.json"
    path.write_text(json.dumps({"tenants": {"A": {"weight": 2, "max_running": 4}, "B": {}}}))
    policy = load_tenant_policy(str(path))
    assert policy.weights == {"A": 2.0, "B": 1.0} and policy.max_running == {"A": 4}
    bad = {
        '{"tenants": {"A": {"weight": 0}}}': "weight must be a finite number > 0",
        '{"tenants": {"A": {"weight": -1}}}': "weight must be a finite number > 0",
        '{"tenants": {"A": {"wieght": 2}}}': "unknown keys",
        '{"tenants": {"A": {"max_running": 0}}}': "max_running must be an integer >= 1",
        '{"weights": {}}': "expected",
        "not json": "not valid JSON",
    }
    for text, message in bad.items():
        path.write_text(text)
        with pytest.raises(ValueError, match=message):
            load_tenant_policy(str(path))
    with pytest.raises(ValueError, match="cannot read"):
        load_tenant_policy(str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match=r"unknown tenants \['C'\]"):
        policy.with_weights({"C": 1.0})
    assert policy.with_weights({"B": 5}).weights == {"A": 2.0, "B": 5.0}


def test_tenant_labels_are_bounded():
    labels = TenantLabels(declared=("gold",), max_labels=2)
    assert [labels(t) for t in ("gold", "x", "y", "z", "x", "default")] == [
        "gold", "x", "y", "other", "x", "default",
    ]  # fmt: skip
