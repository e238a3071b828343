"""The scheduler with one plan in flight (async scheduling) serves exactly what it serves in
lock-step: the same tokens, finish reasons and stops, under preemption, chunked prefill, n > 1
groups, engine stops and aborts, and gives every block back.

A step's "sampled" token depends only on the request and how many tokens it has so far, so
both orders must produce identical outputs however their plans differ.
"""

from __future__ import annotations

import zlib

import pytest

from jserve.core.plan import PLACEHOLDER_TOKEN, StepPlan
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.stopping import StopConditions
from jserve.outputs import FinishReason

from .helpers import EOS, free_block_ids, make_scheduler, tracked


def _token(request_id: str, num_output: int) -> int:
    """EOS about one time in 12, else a filler id; a function of (request, position) only."""
    h = zlib.crc32(f"{request_id}:{num_output}".encode())
    return EOS if h % 12 == 0 else 10 + h % 50


def _requests(num: int, long_every: int, n: int) -> list[Request]:
    """`num` requests (every `long_every`-th one has a long prompt), each of `n` samples."""
    requests = []
    for i in range(num):
        prompt = [3 + (i * 7 + j) % 40 for j in range(40 if i % long_every == 0 else 6 + i % 5)]
        stop = StopConditions(4 + i % 9, i % 3, frozenset({EOS}))
        for k in range(n):
            group = f"g{i}" if n > 1 else None
            requests.append(Request(f"r{i}#{k}", prompt, stop=stop, arrival_time=0.0,
                                    group_id=group))  # fmt: skip
    return requests


class _Driver:
    """Drives a scheduler as the engine does, synchronously or with one plan in flight;
    records each request's output and finish reason, and what async order exercised."""

    def __init__(self, scheduler: Scheduler, stop_id: str | None, abort_id: str | None):
        self.scheduler = scheduler
        self.stop_id = stop_id  # the engine stops it (a stop string) at its third token
        self.abort_id = abort_id  # aborted once its first output token is known
        self.results: dict[str, tuple[list[int], FinishReason]] = {}
        self.live: dict[str, Request] = {}
        self.pending_victims = 0  # preempted while their token was still in flight

    def add(self, requests: list[Request]) -> None:
        for request in requests:
            self.scheduler.add_request(request, now=0.0)
            self.live[request.request_id] = request

    def run_sync(self) -> None:
        while self.scheduler.has_unfinished_requests():
            plan = self.scheduler.schedule(0.0)
            self._update(plan)

    def run_async(self) -> None:
        in_flight: StepPlan | None = None
        while self.scheduler.has_unfinished_requests() or in_flight is not None:
            plan = self.scheduler.schedule(0.0)
            self._check_placeholders(plan, in_flight)
            victims = {  # preempted while the step in flight samples their token
                rid: len(self.live[rid].output_token_ids)
                for rid in plan.preempted_ids
                if self.live[rid].num_pending
            }
            self.pending_victims += len(victims)
            if in_flight is not None:
                self._update(in_flight)
            for rid, num_output in victims.items():  # each kept its token
                request = self.live.get(rid)
                output = self.results[rid][0] if request is None else request.output_token_ids
                assert len(output) == num_output + 1, rid
                assert request is None or request.num_pending == 0
            in_flight = None if plan.is_empty else plan

    def _check_placeholders(self, plan: StepPlan, in_flight: StepPlan | None) -> None:
        """A decode holds a placeholder exactly when the step in flight samples its token."""
        sampling = {s.request_id for s in in_flight.seqs if s.sample} if in_flight else set()
        for seq in plan.seqs[: plan.num_decodes]:
            request = self.live[seq.request_id]
            placeholder = list(seq.token_ids) == [PLACEHOLDER_TOKEN]
            assert placeholder == (seq.request_id in sampling), seq
            assert request.num_pending == (2 if placeholder else 1)  # this plan's own too
            assert seq.start_pos == len(request.all_token_ids) - (0 if placeholder else 1)
        for seq in plan.seqs[plan.num_decodes :]:
            assert PLACEHOLDER_TOKEN not in seq.token_ids

    def _update(self, plan: StepPlan) -> None:
        sampled = {}
        for seq in plan.seqs:
            request = tracked(self.scheduler, seq.request_id)
            if seq.sample and request is not None:
                sampled[seq.request_id] = _token(seq.request_id, len(request.output_token_ids))
        for request in self.scheduler.update_from_output(plan, sampled):
            self._record(request.request_id, request.finish_reason)
        for rid in sampled:
            request = self.live.get(rid)
            if request is None:
                continue
            if rid == self.abort_id:
                assert self.scheduler.abort(rid)
                self._record(rid, FinishReason.ABORT)
            elif rid == self.stop_id and len(request.output_token_ids) == 3:
                assert self.scheduler.finish_request(rid, FinishReason.STOP)
                self._record(rid, FinishReason.STOP)

    def _record(self, request_id: str, reason: FinishReason) -> None:
        request = self.live.pop(request_id)
        assert request_id not in self.results
        self.results[request_id] = (list(request.output_token_ids), reason)


CASES = {
    # name: (scheduler settings, requests, samples each, engine-stopped id, aborted id)
    "roomy": (dict(num_blocks=64), 6, 1, None, None),
    "tight pool: preemption": (
        dict(num_blocks=14, max_model_len=52, max_num_batched_tokens=16),
        8,
        1,
        None,
        None,
    ),
    "chunked prefill, stops, abort": (dict(max_num_batched_tokens=8), 7, 1, "r4#0", "r2#0"),
    "n > 1 groups, prefix caching": (dict(num_blocks=40), 3, 3, None, "r1#1"),
    "no chunked prefill": (
        dict(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=64),
        5,
        1,
        None,
        None,
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_one_plan_in_flight_serves_exactly_what_lock_step_serves(name):
    settings, num, n, stop_id, abort_id = CASES[name]
    results = {}
    for mode in ("sync", "async"):
        scheduler = make_scheduler(**settings)
        driver = _Driver(scheduler, stop_id, abort_id)
        driver.add(_requests(num, long_every=3, n=n))
        getattr(driver, f"run_{mode}")()
        assert not driver.live and not scheduler.has_unfinished_requests()
        manager = scheduler.block_manager
        assert free_block_ids(manager) == set(range(1, manager.num_blocks))
        assert not any(manager.ref_counts)
        results[mode] = driver.results
        if mode == "async" and name.startswith("tight pool"):
            assert scheduler.num_preemptions > 0
            assert driver.pending_victims > 0  # a victim's in-flight token was kept
    assert results["async"] == results["sync"]
    reasons = {reason for _, reason in results["sync"].values()}
    assert FinishReason.STOP in reasons and FinishReason.LENGTH in reasons


def test_a_third_plan_before_the_first_is_updated_is_refused():
    scheduler = make_scheduler()
    scheduler.add_request(Request("r", [3, 4, 5], arrival_time=0.0))
    first = scheduler.schedule(0.0)
    scheduler.schedule(0.0)  # the second may be planned while the first runs
    with pytest.raises(RuntimeError, match="two plans not yet updated"):
        scheduler.schedule(0.0)
    scheduler.update_from_output(first, {"r": 9})
    scheduler.schedule(0.0)  # one in flight again: allowed
