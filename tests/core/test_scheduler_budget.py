"""Chunked prefill, decode-first ordering, prefix reuse, long lane share and watermark."""

from __future__ import annotations

import logging

from jserve.core.request import Request
from jserve.core.scheduler import DECISIONS
from jserve.core.stopping import StopConditions

from .helpers import chunks, make_request, make_scheduler, run_until_idle, step


def test_chunks_split_exactly_at_the_budget():
    scheduler = make_scheduler(max_num_batched_tokens=32)
    scheduler.add_request(make_request("r1", 70, max_tokens=2))
    scheduler.add_request(make_request("r2", 10, first_token=5000, max_tokens=2))
    plans = [step(scheduler)[0] for _ in range(4)]
    assert [chunks(p) for p in plans] == [
        [("r1", 0, 32, False)],
        [("r1", 32, 32, False)],
        [("r1", 64, 6, True), ("r2", 0, 10, True)],
        [("r1", 70, 1, True), ("r2", 10, 1, True)],
    ]
    assert [p.num_batched_tokens for p in plans] == [32, 32, 16, 2]
    assert list(plans[1].seqs[0].token_ids) == list(range(1032, 1064))
    assert list(plans[3].seqs[0].token_ids) == [7]  # the token sampled at the end of the prompt


def test_long_prefill_threshold_caps_each_request_and_decodes_go_first():
    scheduler = make_scheduler(max_num_batched_tokens=32, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("r1", 30, max_tokens=3))
    scheduler.add_request(make_request("r2", 10, first_token=5000, max_tokens=3))
    plans = [step(scheduler)[0] for _ in range(3)]
    assert [chunks(p) for p in plans] == [
        [("r1", 0, 8, False), ("r2", 0, 8, False)],
        [("r1", 8, 8, False), ("r2", 8, 2, True)],
        [("r2", 10, 1, True), ("r1", 16, 8, False)],
    ]
    assert plans[2].num_decodes == 1


def test_block_tables_cover_every_scheduled_position_and_only_grow():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=32)
    scheduler.add_request(make_request("r1", 45, max_tokens=6))
    seen = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler)
        (seq,) = plan.seqs
        needed = -(-(seq.start_pos + seq.num_tokens) // 4)
        assert len(seq.block_ids) == needed  # read before the next schedule()
        seen.append((seq.block_ids, list(seq.block_ids)))
    for live, at_the_time in seen:
        assert live[: len(at_the_time)] == at_the_time


def test_prefix_reuse_and_counters():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=True)
    scheduler.add_request(make_request("first", 20, max_tokens=1))
    run_until_idle(scheduler)
    assert (scheduler.stats().prefix_cache_queries, scheduler.stats().prefix_cache_hits) == (20, 0)

    # Shares the first 18 tokens: 4 full blocks (16 tokens) come from the cache.
    prompt = [*range(1000, 1018), 1, 2, 3, 4]
    second = Request("second", prompt, stop=StopConditions(max_tokens=1), arrival_time=0.0)
    scheduler.add_request(second)
    plan, _ = step(scheduler)
    assert chunks(plan) == [("second", 16, 6, True)]
    assert second.num_cached_tokens == 16
    assert (scheduler.stats().prefix_cache_queries, scheduler.stats().prefix_cache_hits) == (42, 16)

    # The same prompt again: everything but the last token's block is reused.
    scheduler.add_request(make_request("again", 20, max_tokens=1))
    plan, _ = step(scheduler)
    assert chunks(plan) == [("again", 16, 4, True)]
    assert scheduler.stats().prefix_cache_hits == 32


def _shared(request_id: str, prefix_len: int, own: int, max_tokens: int = 2) -> Request:
    prompt = [*range(1000, 1000 + prefix_len), *range(5000 + 100 * own, 5000 + 101 * own)]
    return Request(request_id, prompt, stop=StopConditions(max_tokens), arrival_time=0.0)


def test_a_prefix_in_flight_is_computed_once(caplog):
    """Requests arriving together with a 24-token common prefix: the first computes it, the
    others wait a step for it instead of computing it again in the same step, as a naive
    scheduler would (then every prompt is computed whole)."""
    caplog.set_level(logging.DEBUG, logger=DECISIONS.name)
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    for i in range(1, 4):
        scheduler.add_request(_shared(f"r{i}", 24, own=i + 3))
    plan, _ = step(scheduler)
    assert chunks(plan) == [("r1", 0, 28, True)]
    assert "defer 2 waiting: prefix_in_flight" in caplog.messages
    plan, _ = step(scheduler)
    assert chunks(plan) == [("r1", 28, 1, True), ("r2", 24, 5, True), ("r3", 24, 6, True)]
    run_until_idle(scheduler)
    assert scheduler.stats().prefix_cache_hits == 48


def test_a_short_shared_span_or_a_lost_prefill_does_not_hold_anyone_back():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=64, enable_prefix_caching=True)
    scheduler.add_request(_shared("a", 4, own=8))  # one shared block: below the threshold
    scheduler.add_request(_shared("b", 4, own=9))
    plan, _ = step(scheduler)
    assert [c[:3] for c in chunks(plan)] == [("a", 0, 12), ("b", 0, 13)]

    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)
    scheduler.add_request(_shared("long", 40, own=4))  # chunked over several steps
    scheduler.add_request(_shared("same", 40, own=5))
    plan, _ = step(scheduler)
    assert chunks(plan) == [("long", 0, 16, False)]
    scheduler.abort("long")  # its blocks will never be computed: no one waits for them
    plan, _ = step(scheduler)
    assert chunks(plan)[0][:3] == ("same", 16, 16)  # the 16 tokens cached before the abort


def test_prefix_caching_off_recomputes_everything():
    scheduler = make_scheduler(block_size=4, enable_prefix_caching=False)
    scheduler.add_request(make_request("first", 20, max_tokens=1))
    run_until_idle(scheduler)
    scheduler.add_request(make_request("again", 20, max_tokens=1))
    plan, _ = step(scheduler)
    assert chunks(plan) == [("again", 0, 20, True)]
    assert scheduler.stats().prefix_cache_queries == 0


def test_long_lane_share_is_capped_while_others_share_the_step():
    scheduler = make_scheduler(
        max_num_batched_tokens=32, long_prompt_threshold=16, long_lane_max_share=0.25
    )
    scheduler.add_request(make_request("chat", 4, max_tokens=20))
    step(scheduler)  # "chat" is decoding from now on
    doc = make_request("doc", 40, first_token=5000, max_tokens=2)
    scheduler.add_request(doc)
    assert doc.lane == "long"
    plan, _ = step(scheduler)
    assert chunks(plan) == [("chat", 4, 1, True), ("doc", 0, 8, False)]
    scheduler.abort("chat")
    plan, _ = step(scheduler)  # alone now: the long prompt may use the whole step
    assert chunks(plan) == [("doc", 8, 32, True)]


def test_no_new_prefill_below_the_free_block_watermark():
    # 20 usable blocks of 4 tokens; watermark 0.25 keeps 5 free.
    scheduler = make_scheduler(
        block_size=4, num_blocks=21, max_model_len=60, free_block_watermark=0.25
    )
    scheduler.add_request(make_request("a", 48, max_tokens=8))  # 12 blocks: 8 left
    step(scheduler)
    scheduler.add_request(make_request("b", 16, first_token=5000, max_tokens=8))  # 4 blocks
    plan, _ = step(scheduler)
    assert [s.request_id for s in plan.seqs] == ["a"]  # 8 - 4 = 4 < 5: b waits
    assert scheduler.stats().num_waiting == 1
    scheduler.abort("a")
    plan, _ = step(scheduler)
    assert chunks(plan) == [("b", 0, 16, True)]


def test_without_chunked_prefill_a_prompt_runs_whole_or_waits():
    scheduler = make_scheduler(
        max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False
    )
    scheduler.add_request(make_request("r1", 40, max_tokens=4))
    scheduler.add_request(make_request("r2", 30, first_token=5000, max_tokens=4))
    plans = [step(scheduler)[0] for _ in range(2)]
    assert [chunks(p) for p in plans] == [
        [("r1", 0, 40, True)],
        [("r1", 40, 1, True), ("r2", 0, 30, True)],
    ]
