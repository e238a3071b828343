"""Admission rejections, n > 1 groups, deadlines, aborts and stop conditions."""

from __future__ import annotations

import dataclasses

import pytest

from jserve.core.request import RequestStatus
from jserve.core.step_costs import StepCosts
from jserve.core.tenants import TenantPolicy
from jserve.errors import RequestRejected
from jserve.outputs import FinishReason

from .helpers import (
    EOS,
    FILLER,
    chunks,
    make_request,
    make_scheduler,
    run_until_idle,
    step,
    tracked,
)


def rejection(scheduler, request) -> RequestRejected:
    with pytest.raises(RequestRejected) as error:
        scheduler.add_request(request)
    assert request.status is RequestStatus.FINISHED
    assert request.finish_reason is None
    return error.value


def test_too_long_names_both_numbers():
    scheduler = make_scheduler(max_model_len=128)
    error = rejection(scheduler, make_request("r", 100, max_tokens=29))
    assert error.reason == "too_long"
    assert "the prompt has 100 tokens and max_tokens is 29" in str(error)
    assert "129 tokens exceed max_model_len=128" in str(error)
    scheduler.add_request(make_request("fits", 100, max_tokens=28))


def test_the_queue_cap_counts_every_sample_of_a_group():
    scheduler = make_scheduler(max_waiting_requests=3)
    scheduler.add_request(make_request("a", 4))
    scheduler.add_request(make_request("g-0", 4, group_id="g"))
    scheduler.add_request(make_request("g-1", 4, group_id="g"))
    for sibling_or_new in (make_request("g-2", 4, group_id="g"), make_request("b", 4)):
        error = rejection(scheduler, sibling_or_new)
        assert error.reason == "queue_full"
        assert str(error) == (
            "3 sequences are already waiting (max_waiting_requests=3, each of a request's n "
            "samples counts); retry later"
        )
    assert scheduler.stats().num_waiting == 3


@pytest.mark.parametrize(
    ("request_kwargs", "message"),
    [
        ({"prompt_len": 0}, "the prompt has no tokens"),
        ({"prompt_len": 4, "max_tokens": 0}, "max_tokens must be >= 1"),
        ({"prompt_len": 4, "lane": "vip"}, "lane must be one of ('interactive', 'long', 'batch')"),
    ],
)
def test_invalid_requests(request_kwargs, message):
    scheduler = make_scheduler()
    error = rejection(
        scheduler, make_request("r", request_kwargs.pop("prompt_len"), **request_kwargs)
    )
    assert error.reason == "invalid"
    assert message in str(error)


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize(("prompt_len", "shared_blocks"), [(10, 2), (8, 1)])
def test_siblings_wait_for_the_leader_then_fork_its_full_prompt_blocks(
    prefix_caching, prompt_len, shared_blocks
):
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=prefix_caching)
    for index in range(3):
        scheduler.add_request(make_request(f"g-{index}", prompt_len, group_id="g", max_tokens=3))
    plan, _ = step(scheduler)
    assert chunks(plan) == [("g-0", 0, prompt_len, True)]
    plan, _ = step(scheduler)
    tail = prompt_len - 4 * shared_blocks
    assert chunks(plan) == [
        ("g-0", prompt_len, 1, True),
        ("g-1", 4 * shared_blocks, tail, True),
        ("g-2", 4 * shared_blocks, tail, True),
    ]
    leader, *siblings = (tracked(scheduler, f"g-{i}") for i in range(3))
    shared = leader.block_ids[:shared_blocks]
    manager = scheduler.block_manager
    assert [manager.ref_counts[b] for b in shared] == [3] * shared_blocks
    for sibling in siblings:
        assert sibling.block_ids[:shared_blocks] == shared
        assert sibling.num_cached_tokens == 4 * shared_blocks
        # The blocks each one writes next are its own.
        assert not set(sibling.block_ids[shared_blocks:]) & set(leader.block_ids)
    assert not set(siblings[0].block_ids[shared_blocks:]) & set(siblings[1].block_ids)
    if prefix_caching:  # forks are not cache lookups
        assert (scheduler.stats().prefix_cache_queries, scheduler.stats().prefix_cache_hits) == (
            prompt_len,
            0,
        )
    run_until_idle(scheduler)
    assert manager.num_free_blocks == manager.num_usable_blocks


def test_siblings_of_a_finished_leader_prefill_on_their_own():
    scheduler = make_scheduler(block_size=4, max_num_seqs=1, enable_prefix_caching=False)
    scheduler.add_request(make_request("g-0", 10, group_id="g", max_tokens=1))
    scheduler.add_request(make_request("g-1", 10, group_id="g", max_tokens=1))
    plans = run_until_idle(scheduler)
    assert [chunks(p) for p in plans] == [[("g-0", 0, 10, True)], [("g-1", 0, 10, True)]]


def test_waiting_request_past_its_deadline_finishes_with_deadline():
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("busy", 4, max_tokens=10))
    scheduler.add_request(make_request("late", 4, deadline=5.0))
    step(scheduler, now=1.0)
    plan, _ = step(scheduler, now=4.9)
    assert plan.finished == {}
    plan, _ = step(scheduler, now=5.0)
    assert plan.finished == {"late": FinishReason.TIMEOUT}
    assert tracked(scheduler, "late") is None
    assert scheduler.stats().num_waiting == 0
    assert [s.request_id for s in plan.seqs] == ["busy"]


def test_running_request_past_its_deadline_finishes_with_deadline_and_keeps_its_tokens():
    scheduler = make_scheduler(block_size=4)
    manager = scheduler.block_manager
    request = make_request("run", 6, max_tokens=10, deadline=3.0)
    scheduler.add_request(request)
    for now in (0.0, 1.0, 2.0):
        plan, _ = step(scheduler, now=now)
        assert plan.finished == {}
    assert request.status is RequestStatus.RUNNING and request.num_output_tokens == 3
    plan = scheduler.schedule(3.0)
    assert plan.finished == {"run": FinishReason.TIMEOUT} and plan.is_empty
    assert request.finish_reason is FinishReason.TIMEOUT
    assert list(request.output_token_ids) == [FILLER] * 3
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert not scheduler.has_unfinished_requests() and scheduler.running == []


def test_abort_in_each_state_frees_at_once():
    scheduler = make_scheduler(block_size=4, max_num_seqs=1)
    manager = scheduler.block_manager
    scheduler.add_request(make_request("run", 10, max_tokens=8))
    scheduler.add_request(make_request("wait", 4))
    step(scheduler)
    assert manager.num_free_blocks == manager.num_usable_blocks - 3
    assert scheduler.abort("run")
    assert manager.num_free_blocks == manager.num_usable_blocks
    assert scheduler.abort("wait")
    assert not scheduler.abort("wait")
    assert not scheduler.abort("never-added")
    plan = scheduler.schedule(0.0)
    assert plan.finished == {}  # the caller ended them: nothing to report back
    assert plan.is_empty and not scheduler.has_unfinished_requests()


def test_abort_while_the_step_runs_is_skipped_by_update():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4))
    scheduler.add_request(make_request("s", 4, first_token=2000))
    plan = scheduler.schedule(0.0)
    scheduler.abort("r")
    finished = scheduler.update_from_output(plan, {"r": 5, "s": 5})
    assert finished == []
    assert list(tracked(scheduler, "s").output_token_ids) == [5]


def test_stop_token_respects_min_tokens_and_max_tokens_gives_length():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("stop", 4, min_tokens=2, max_tokens=5))
    scheduler.add_request(make_request("long", 4, first_token=2000, max_tokens=3))
    finished = []
    for _ in range(3):
        finished += step(scheduler, lambda request_id: EOS if request_id == "stop" else 9)[1]
    assert [(r.request_id, r.finish_reason) for r in finished] == [
        ("stop", FinishReason.STOP),
        ("long", FinishReason.LENGTH),
    ]
    assert list(finished[0].output_token_ids) == [EOS, EOS]
    assert list(finished[1].output_token_ids) == [9, 9, 9]


def test_finish_request_for_a_stop_string_is_not_reported_again():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4))
    step(scheduler)
    assert scheduler.finish_request("r", FinishReason.STOP)
    assert not scheduler.finish_request("r", FinishReason.STOP)
    assert scheduler.schedule(0.0).finished == {}
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_usable_blocks


def test_a_missing_sampled_token_is_an_error_that_names_the_request():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", 4))
    plan = scheduler.schedule(0.0)
    with pytest.raises(ValueError, match="no sampled token for request 'r'"):
        scheduler.update_from_output(plan, {})


def test_a_fresh_scheduler_keeps_settings_policy_costs_and_event_recording_but_no_requests():
    costs = StepCosts([32], [8])
    scheduler = make_scheduler(block_size=4, num_blocks=48, step_costs=costs)
    scheduler.record_kv_events()
    scheduler.reconfigure(dataclasses.replace(scheduler.config, max_num_seqs=4))
    scheduler.fair.policy = TenantPolicy(weights={"a": 2.0})
    scheduler.add_request(make_request("r", 9))
    step(scheduler)
    assert [type(e).__name__ for e in scheduler.take_kv_events()] == ["BlocksStored"]

    fresh = scheduler.fresh()
    assert fresh.config is scheduler.config and fresh.config.max_num_seqs == 4
    assert fresh.cache_config == scheduler.cache_config
    assert fresh.num_usable_blocks == 47
    assert fresh.fair.policy is scheduler.fair.policy and fresh.step_costs is costs
    assert not fresh.has_unfinished_requests() and fresh.stats().kv_cache_usage == 0.0
    fresh.add_request(make_request("s", 9))
    step(fresh)
    assert [type(e).__name__ for e in fresh.take_kv_events()] == ["BlocksStored"]
    assert make_scheduler().fresh().take_kv_events() == []  # not recording stays so
