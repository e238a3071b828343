"""Random arrivals, aborts, engine stops and steps against the scheduler, checking invariants.

A shadow KV pool records, for every slot a plan writes, which prefix of tokens produced it; a
seq may only be scheduled when the slots its table maps for earlier positions hold exactly
its own prefix. So a wrong prefix hit, a fork of a block someone still writes,
or a block reused while referenced all show up as a mismatch.
"""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jserve.config import CacheConfig, SchedulerConfig
from jserve.core.block_manager import SINK_BLOCK_ID
from jserve.core.request import Request, RequestStatus
from jserve.core.scheduler import Scheduler
from jserve.errors import RequestRejected
from jserve.stopping import FinishReason, StopConditions

EOS = 2
SHARED_PREFIXES = [tuple(range(3, 3 + 40)), tuple(range(50, 50 + 40))]


@st.composite
def configs(draw) -> tuple[SchedulerConfig, CacheConfig]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    max_num_seqs = draw(st.integers(1, 6))
    max_model_len = draw(st.integers(8, 96))
    chunked = draw(st.booleans())
    budget = max(max_num_seqs, draw(st.integers(4, 48)))
    if not chunked:
        budget = max(budget, max_model_len)
    watermark = draw(st.sampled_from([0.0, 0.05, 0.2]))
    scheduler_config = SchedulerConfig(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        long_prefill_token_threshold=draw(st.integers(0, budget)) if chunked else 0,
        long_prompt_threshold=draw(st.integers(1, max_model_len)),
        long_lane_max_share=draw(st.sampled_from([0.1, 0.5, 1.0])),
        max_waiting_requests=draw(st.integers(1, 12)),
        free_block_watermark=watermark,
        aging_iterations=draw(st.integers(1, 12)),
        scheduling=draw(st.sampled_from(["continuous", "continuous", "static"])),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
    )
    blocks_per_seq = -(-max_model_len // block_size)
    # From "one request fills the pool" (preemption every few steps) to plenty.
    extra = draw(st.sampled_from([0, 1, blocks_per_seq // 2, 3 * blocks_per_seq]))
    usable = int((blocks_per_seq + extra) / (1.0 - watermark)) + 1
    return scheduler_config, CacheConfig(block_size=block_size, num_blocks=usable + 1)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs())
    def setup(self, config):
        self.config, cache_config = config
        self.block_size = cache_config.block_size
        self.scheduler = Scheduler(self.config, cache_config)
        self.manager = self.scheduler.block_manager
        self.live: dict[str, Request] = {}  # added and not yet reported finished
        self.reported: set[str] = set()
        self.shadow: dict[int, list] = {}  # block id -> per-slot prefix key
        self.now = 0.0
        self.num_added = 0

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        data=st.data(),
        lane=st.sampled_from(["interactive", "interactive", "long", "batch"]),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        deadline=st.none() | st.floats(0.0, 6.0),
    )
    def add(self, data, lane, n, deadline):
        max_model_len = self.config.max_model_len
        prompt_len = data.draw(st.integers(1, max_model_len + 2), label="prompt_len")
        max_tokens = data.draw(st.integers(1, 24), label="max_tokens")
        if prompt_len + max_tokens > max_model_len and data.draw(st.booleans()):
            max_tokens = max(1, max_model_len - prompt_len)  # mostly requests that fit
        prefix = data.draw(st.sampled_from([(), *SHARED_PREFIXES]))[:prompt_len]
        tail_len = prompt_len - len(prefix)
        tail = data.draw(st.lists(st.integers(3, 12), min_size=tail_len, max_size=tail_len))
        prompt = list(prefix) + tail
        group_id = f"g{self.num_added}" if n > 1 else None
        members = []
        for _ in range(n):
            self.num_added += 1
            request = Request(
                f"r{self.num_added}",
                prompt,
                stop=StopConditions(
                    max_tokens, data.draw(st.integers(0, max_tokens)), frozenset({EOS})
                ),
                arrival_time=self.now,
                lane=lane,
                deadline=None if deadline is None else self.now + deadline,
                group_id=group_id,
            )
            too_long = prompt_len + max_tokens > self.config.max_model_len
            queue_full = len(self.scheduler.waiting) >= self.config.max_waiting_requests
            try:
                self.scheduler.add_request(request)
            except RequestRejected as error:
                expected = "too_long" if too_long else "queue_full" if queue_full else None
                assert error.reason == expected, (error.reason, str(error))
                for added in members:  # as the engine does: all samples or none
                    assert self.scheduler.abort(added)
                    self.live.pop(added)
                return
            assert not too_long and not queue_full
            self.live[request.request_id] = request
            members.append(request.request_id)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.live)))
        assert self.scheduler.abort(request_id)
        request = self.live.pop(request_id)
        assert request.block_ids == [] and request.status is RequestStatus.FINISHED

    @precondition(lambda self: self.scheduler.running)
    @rule(data=st.data())
    def engine_stops_one(self, data):
        request = data.draw(st.sampled_from(self.scheduler.running))
        assert self.scheduler.finish_request(request.request_id, FinishReason.STOP)
        self._report(request.request_id)

    @rule(eos_probability=st.sampled_from([0.0, 0.1, 0.5]), data=st.data())
    def step(self, eos_probability, data):
        self._step(lambda: EOS if data.draw(st.floats(0, 1)) < eos_probability else 7)

    @rule()
    def drain(self):
        """With no new arrivals, everything admitted finishes within a bound."""
        work = sum(r.num_prompt_tokens + r.stop.max_tokens for r in self.live.values())
        bound = work * (len(self.live) + 1) + 50
        for _ in range(bound):
            if not self.live:
                break
            self._step(lambda: 7)
        assert not self.live, f"{len(self.live)} requests left after {bound} steps"
        assert not self.scheduler.has_unfinished_requests()
        assert self.manager.free_block_ids() == set(range(1, self.manager.num_blocks))
        assert not any(self.manager.ref_counts)

    def teardown(self):
        if hasattr(self, "scheduler"):
            self.drain()

    # ---- one step, checked -----------------------------------------------------------------

    def _step(self, next_token):
        now = self.now
        plan = self.scheduler.schedule(now)
        self.now += 1.0
        for request_id, reason in plan.finished.items():
            assert reason == "timeout"  # aborts and engine stops are not reported back
            request = self.live[request_id]
            assert request.deadline <= now and request.block_ids == []
            self._report(request_id)
        for request in self.live.values():  # waiting or running: none outlives its deadline
            assert request.deadline is None or request.deadline > now
        self._check_plan(plan)
        sampled = {seq.request_id: next_token() for seq in plan.seqs if seq.sample}
        for request in self.scheduler.update_from_output(plan, sampled):
            assert request.finish_reason in ("stop", "length")
            if request.finish_reason == "stop":
                assert request.output_token_ids[-1] == EOS
                assert request.num_output_tokens >= request.stop.min_tokens
            else:
                assert request.num_output_tokens == request.stop.max_tokens
            self._report(request.request_id)

    def _report(self, request_id):
        assert request_id not in self.reported, f"{request_id} reported finished twice"
        self.reported.add(request_id)
        del self.live[request_id]

    def _check_plan(self, plan):
        seqs = plan.seqs
        assert plan.num_batched_tokens == sum(s.num_tokens for s in seqs)
        assert plan.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(seqs) <= self.config.max_num_seqs
        assert len({s.request_id for s in seqs}) == len(seqs)
        assert all(s.num_tokens == 1 and s.sample for s in seqs[: plan.num_decodes])
        for request_id in plan.preempted_ids:
            request = self.live[request_id]
            assert request.status is RequestStatus.PREEMPTED and not request.block_ids
        writes = []
        for seq in seqs:
            request = self.live[seq.request_id]
            assert request.status is RequestStatus.RUNNING
            assert seq.num_tokens >= 1
            assert not self.config.long_prefill_token_threshold or (
                seq.num_tokens <= max(1, self.config.long_prefill_token_threshold)
            )
            end = seq.start_pos + seq.num_tokens
            assert seq.start_pos == request.num_computed_tokens
            assert list(seq.token_ids) == list(request.all_token_ids[seq.start_pos : end])
            assert seq.sample == (end == request.num_tokens)
            assert seq.block_ids is request.block_ids
            assert len(seq.block_ids) == -(-end // self.block_size)
            assert SINK_BLOCK_ID not in seq.block_ids
            keys = self._prefix_keys(request, end)
            for position in range(end):
                block = seq.block_ids[position // self.block_size]
                slot = position % self.block_size
                if position < seq.start_pos:  # reads: must be this request's own prefix
                    assert self.shadow[block][slot] == keys[position], (seq, position)
                else:
                    writes.append((block, slot, keys[position]))
        for block, slot, key in writes:
            # Written blocks are private and not (yet) in the prefix cache.
            assert self.manager.ref_counts[block] == 1
            cache = self.manager.prefix_cache
            assert cache is None or not cache.is_cached(block)
            self.shadow.setdefault(block, [None] * self.block_size)[slot] = key

    @staticmethod
    def _prefix_keys(request, end):
        keys = []
        key = hash("root")
        for token in request.all_token_ids[:end]:
            key = hash((key, token))
            keys.append(key)
        return keys

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "scheduler"):
            return
        manager = self.manager
        held = [0] * manager.num_blocks
        for request in self.live.values():
            for block in request.block_ids:
                held[block] += 1
        assert list(manager.ref_counts) == held
        free = manager.free_block_ids()
        referenced = {b for b, count in enumerate(held) if count}
        assert not free & referenced
        assert free | referenced == set(range(1, manager.num_blocks))
        assert SINK_BLOCK_ID not in free and held[SINK_BLOCK_ID] == 0
        if manager.prefix_cache is not None:
            cached = manager.prefix_cache.cached_block_ids()
            assert manager.prefix_cache.evictable_block_ids() == cached - referenced

    @invariant()
    def request_states_are_consistent(self):
        if not hasattr(self, "scheduler"):
            return
        scheduler = self.scheduler
        running = scheduler.running
        assert len(running) <= self.config.max_num_seqs
        assert [r.rank for r in running] == sorted(r.rank for r in running)
        assert {r.request_id for r in running} == {
            r.request_id for r in self.live.values() if r.status is RequestStatus.RUNNING
        }
        waiting = [r for r in self.live.values() if r.status is not RequestStatus.RUNNING]
        assert len(scheduler.waiting) == len(waiting)
        for request in waiting:
            assert request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
            assert request.block_ids == [] and request.num_computed_tokens == 0
        for request in running:
            assert len(request.block_ids) * self.block_size >= request.num_computed_tokens
        assert scheduler.has_unfinished_requests() == bool(self.live)


def machine_settings(max_examples: int, steps: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
    )


def test_scheduler_state_machine():
    run_state_machine_as_test(SchedulerMachine, settings=machine_settings(150, 50))


@pytest.mark.slow
def test_scheduler_state_machine_long():
    run_state_machine_as_test(SchedulerMachine, settings=machine_settings(2000, 80))
