"""Preemption (victim, resume, queue position), lane priority with aging, static policy."""

from __future__ import annotations

from jserve.core.request import RequestStatus

from .helpers import chunks, make_request, make_scheduler, run_until_idle, step, tracked


def counting_token(scheduler):
    """Each request's k-th output token is 100 + k, so lost or repeated tokens show."""
    return lambda request_id: 100 + tracked(scheduler, request_id).num_output_tokens


def test_victim_is_latest_arrival_and_it_resumes_with_its_tokens():
    # 12 usable blocks of 4 tokens: three 12-token prompts fill 9, their decodes the rest.
    scheduler = make_scheduler(
        block_size=4, num_blocks=13, max_model_len=32, max_num_seqs=3, max_num_batched_tokens=64
    )
    for arrival, name in enumerate("abc"):
        scheduler.add_request(
            make_request(
                name,
                12,
                first_token=1000 * (arrival + 1),
                max_tokens=20,
                arrival_time=float(arrival),
            )
        )
    scheduler.add_request(make_request("d", 4, first_token=9000, arrival_time=3.0))
    token = counting_token(scheduler)
    for _ in range(5):
        plan, _ = step(scheduler, token)
        assert plan.preempted_ids == []
    c = tracked(scheduler, "c")
    assert list(c.output_token_ids) == [100, 101, 102, 103, 104]

    plan, _ = step(scheduler, token)  # position 16 needs a 5th block: none is free
    assert plan.preempted_ids == ["c"]
    assert [s.request_id for s in plan.seqs] == ["a", "b"]
    assert c.status is RequestStatus.PREEMPTED and c.block_ids == []
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1
    assert list(c.output_token_ids) == [100, 101, 102, 103, 104]  # kept
    assert [r.request_id for r in scheduler.waiting.queue("interactive")] == ["c", "d"]

    resumed = None
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, token)
        resumed = resumed or next((s for s in plan.seqs if s.request_id == "c"), None)
    # The recompute covers prompt and kept outputs, then samples the 6th token.
    assert (resumed.start_pos, resumed.sample) == (0, True)
    assert list(resumed.token_ids) == [*range(3000, 3012), 100, 101, 102, 103, 104]
    assert list(c.output_token_ids) == list(range(100, 120))
    assert scheduler.stats().num_preemptions >= 1


def test_victim_is_the_lowest_lane_before_the_latest_arrival():
    scheduler = make_scheduler(block_size=4, num_blocks=5, max_model_len=16, max_num_seqs=2)
    scheduler.add_request(make_request("old-batch", 6, lane="batch", arrival_time=0.0))
    scheduler.add_request(
        make_request("new-chat", 8, first_token=5000, max_tokens=8, arrival_time=5.0)
    )
    step(scheduler)  # all 4 usable blocks taken
    plan, _ = step(scheduler)  # new-chat's position 8 needs a block
    assert plan.preempted_ids == ["old-batch"]
    assert chunks(plan) == [("new-chat", 8, 1, True)]


def test_a_prefill_that_needs_blocks_preempts_a_lower_priority_scheduled_decode():
    scheduler = make_scheduler(
        block_size=4, num_blocks=9, max_model_len=32, max_num_seqs=2, max_num_batched_tokens=8
    )
    scheduler.add_request(make_request("bat", 3, lane="batch", max_tokens=10))
    step(scheduler)
    scheduler.add_request(make_request("chat", 28, first_token=5000, arrival_time=1.0))
    plans = [step(scheduler)[0] for _ in range(5)]
    assert [chunks(p) for p in plans[:4]] == [
        [("bat", 3, 1, True), ("chat", 0, 7, False)],
        [("bat", 4, 1, True), ("chat", 7, 7, False)],
        [("bat", 5, 1, True), ("chat", 14, 7, False)],
        [("bat", 6, 1, True), ("chat", 21, 3, False)],  # shrunk to the blocks it holds
    ]
    # No block left for chat: the batch decode, already planned, is taken back and preempted.
    assert chunks(plans[4]) == [("chat", 24, 4, True)]
    assert plans[4].preempted_ids == ["bat"]
    assert (plans[4].num_decodes, plans[4].num_batched_tokens) == (0, 4)
    run_until_idle(scheduler)


def test_strict_lane_priority_then_fifo():
    scheduler = make_scheduler(max_num_seqs=1, long_prompt_threshold=8)
    scheduler.add_request(make_request("bat", 4, lane="batch", max_tokens=1, arrival_time=0.0))
    scheduler.add_request(make_request("doc", 10, max_tokens=1, arrival_time=1.0))
    scheduler.add_request(make_request("chat-1", 4, max_tokens=1, arrival_time=2.0))
    scheduler.add_request(make_request("chat-2", 4, max_tokens=1, arrival_time=3.0))
    assert tracked(scheduler, "doc").lane == "long"
    order = [plan.seqs[0].request_id for plan in run_until_idle(scheduler)]
    assert order == ["chat-1", "chat-2", "doc", "bat"]


def test_aging_bounds_the_wait_of_a_lower_lane():
    def first_step_of_batch(aging_iterations: int, steps: int) -> int | None:
        scheduler = make_scheduler(max_num_seqs=1, aging_iterations=aging_iterations)
        scheduler.add_request(make_request("bat", 4, lane="batch", max_tokens=1))
        for index in range(1, steps + 1):
            # A fresh interactive request arrives every iteration.
            scheduler.add_request(make_request(f"chat-{index}", 4, max_tokens=1))
            plan, _ = step(scheduler)
            if plan.seqs[0].request_id == "bat":
                return index
        return None

    assert first_step_of_batch(aging_iterations=5, steps=20) == 5
    assert first_step_of_batch(aging_iterations=1000, steps=20) is None


def test_aging_puts_one_request_ahead_per_period_not_a_lane():
    """An old backlog in a lower lane gets one admission every aging_iterations steps while a
    higher lane is busy; it does not take every slot that frees because its requests are old
    (that would make lane priority first come, first served in any long overload)."""
    scheduler = make_scheduler(max_num_seqs=1, aging_iterations=4)
    for index in range(6):
        scheduler.add_request(make_request(f"bat-{index}", 4, lane="batch", max_tokens=1))
    batch_steps = []
    for index in range(1, 25):
        scheduler.add_request(make_request(f"chat-{index}", 4, max_tokens=1))
        plan, _ = step(scheduler)
        if plan.seqs[0].request_id.startswith("bat"):
            batch_steps.append(index)
    # The first once the backlog waited 4 steps, then one every 4 steps of chat traffic.
    assert batch_steps == [4, 8, 12, 16, 20, 24]


def test_static_policy_admits_a_batch_only_when_nothing_runs():
    def first_steps(policy: str) -> dict[str, int]:
        scheduler = make_scheduler(max_num_seqs=2, scheduling=policy)
        scheduler.add_request(make_request("a", 4, max_tokens=2))
        scheduler.add_request(make_request("b", 4, first_token=2000, max_tokens=6))
        scheduler.add_request(make_request("c", 4, first_token=3000, max_tokens=2))
        first = {}
        for index, plan in enumerate(run_until_idle(scheduler), start=1):
            for seq in plan.seqs:
                first.setdefault(seq.request_id, index)
        return first

    # a finishes in step 2, b in step 6: static waits for b, continuous fills a's slot at once.
    assert first_steps("static") == {"a": 1, "b": 1, "c": 7}
    assert first_steps("continuous") == {"a": 1, "b": 1, "c": 3}


def test_static_policy_prefills_the_whole_batch_in_budget_sized_chunks():
    scheduler = make_scheduler(max_num_seqs=4, max_num_batched_tokens=32, scheduling="static")
    for index in range(3):
        scheduler.add_request(make_request(f"r{index}", 20, first_token=1000 * (index + 1)))
    plans = [step(scheduler)[0] for _ in range(2)]
    assert chunks(plans[0]) == [("r0", 0, 20, True), ("r1", 0, 12, False)]
    assert chunks(plans[1]) == [("r0", 20, 1, True), ("r1", 12, 8, True), ("r2", 0, 20, True)]


def test_static_batches_leave_a_whole_prompts_rows_to_its_prompt_logprobs():
    """Without chunked prefill a prompt-logprobs prompt takes a row per token in one step,
    beside a row for each other request of the batch. Two 5-token prompts under 5 rows did
    not fit together and, admitted together, ran forever unplanned (hypothesis found it)."""
    scheduler = make_scheduler(
        max_num_seqs=5, max_model_len=32, scheduling="static", enable_chunked_prefill=False
    )
    for index in range(2):
        scheduler.add_request(make_request(f"r{index}", 5, max_tokens=1, prompt_rows=True))
    scheduler.add_request(make_request("plain", 3, first_token=2000, max_tokens=1))
    plans = run_until_idle(scheduler, max_steps=10)
    # r0 runs alone (5 rows + 1 for any partner > 5), then r1 alone, then the plain one.
    assert [chunks(plan) for plan in plans] == [
        [("r0", 0, 5, True)],
        [("r1", 0, 5, True)],
        [("plain", 0, 3, True)],
    ]
    assert all(plan.num_rows <= 5 for plan in plans)
