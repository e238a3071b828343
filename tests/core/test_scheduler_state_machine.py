"""Random arrivals, aborts, engine stops and steps against the scheduler, checking invariants.

A shadow KV pool records, for every slot a plan writes, which prefix of tokens produced it; a
seq may only be scheduled when the slots its table maps for earlier positions hold exactly
its own prefix. So a wrong prefix hit, a fork of a block someone still writes,
or a block reused while referenced all show up as a mismatch.

Requests come from three tenants of different weights; with fairness="vtc" the service gap
between two tenants continuously backlogged in a lane must stay within the bound
jserve.core.fairness derives (`fair_share_gap_is_bounded`).

With speculative decoding, decodes of requests that may speculate carry n-gram drafts, of
which the step accepts a random number: a draft's slot records the prefix with the drafts
before it, so a rejected draft's KV read later, or hashed into the prefix cache, shows up as
a mismatch too.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from jserve.config.scheduler import LANES, CacheConfig, SchedulerConfig
from jserve.core.block_manager import SINK_BLOCK_ID
from jserve.core.fairness import DECODE_TOKEN_COST
from jserve.core.request import Request, RequestStatus
from jserve.core.scheduler import Scheduler
from jserve.core.stopping import StopConditions
from jserve.core.tenants import TenantPolicy
from jserve.errors import RequestRejected
from jserve.outputs import FinishReason
from tests.budgets import THOROUGH, examples

from .helpers import free_block_ids

EOS = 2
SHARED_PREFIXES = [tuple(range(3, 3 + 40)), tuple(range(50, 50 + 40))]
TENANTS = ("a", "b", "c")


def service_gap_bound(max_num_seqs: int, max_model_len: int, weight: float) -> float:
    """B: the most service a tenant of `weight` can still receive from its admitted requests
    of one lane (the gap bound between backlogged tenants, beyond their starting gap; see
    jserve.core.fairness)."""
    return max_num_seqs * max_model_len * DECODE_TOKEN_COST / weight


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
        fairness=draw(st.sampled_from(["vtc", "vtc", "fcfs"])),
        enable_chunked_prefill=chunked,
        enable_prefix_caching=draw(st.booleans()),
        speculative_config=draw(
            st.none()
            | st.builds(
                lambda method, k, n: json.dumps(
                    {
                        "method": method,
                        "num_speculative_tokens": k,
                        "prompt_lookup_max": n,
                        "suffix_decoding_max_spec_factor": n,
                    }
                ),
                st.sampled_from(["ngram", "suffix"]),
                st.integers(1, 4),
                st.integers(1, 3),
            )
        ),
    )
    blocks_per_seq = -(-max_model_len // block_size)
    # From "one request fills the pool" (preemption every few steps) to plenty.
    extra = draw(st.sampled_from([0, 1, blocks_per_seq // 2, 3 * blocks_per_seq]))
    usable = int((blocks_per_seq + extra) / (1.0 - watermark)) + 1
    weights = {
        "a": 1.0,
        "b": draw(st.sampled_from([1.0, 2.0])),
        "c": draw(st.sampled_from([0.5, 1.0])),
    }
    cache_config = CacheConfig(block_size=block_size, num_blocks=usable + 1)
    return scheduler_config, cache_config, TenantPolicy(weights)


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(config=configs())
    def setup(self, config):
        self.config, cache_config, tenants = config
        self.block_size = cache_config.block_size
        self.scheduler = Scheduler(self.config, cache_config, tenants)
        self.check_fairness = (
            self.config.fairness == "vtc" and self.config.scheduling == "continuous"
        )
        self.gap_bound = {
            t: service_gap_bound(self.config.max_num_seqs, self.config.max_model_len, w)
            for t, w in tenants.weights.items()
        }
        # lane -> (f, g) -> their counters when both became backlogged
        self.gap_starts = {lane: {} for lane in LANES}
        self.gaps_checked = 0
        self.manager = self.scheduler.block_manager
        self.live: dict[str, Request] = {}  # added and not yet reported finished
        self.reported: set[str] = set()
        self.shadow: dict[int, list] = {}  # block id -> per-slot prefix key
        self.now = 0.0
        self.num_added = 0
        self.rows_pending: set[str] = set()  # prompt_rows requests whose prompt is unplanned

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        data=st.data(),
        lane=st.sampled_from(["interactive", "interactive", "long", "batch"]),
        n=st.sampled_from([1, 1, 1, 2, 3]),
        deadline=st.none() | st.floats(0.0, 6.0),
        tenant=st.sampled_from(TENANTS),
    )
    def add(self, data, lane, n, deadline, tenant):
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
        # A row at every prompt position (as the engine asks for prompt logprobs); without
        # chunked prefill the engine refuses prompts longer than max_num_seqs.
        fits = self.config.enable_chunked_prefill or prompt_len <= self.config.max_num_seqs
        prompt_rows = fits and data.draw(st.booleans(), label="prompt_rows")
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
                tenant=tenant,
                can_speculate=data.draw(st.booleans()),
                prompt_rows=prompt_rows,
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
            if prompt_rows:
                self.rows_pending.add(request.request_id)
            members.append(request.request_id)

    @rule(
        heavy=st.sampled_from(TENANTS),
        light=st.sampled_from(TENANTS),
        count=st.integers(2, 6),
        prompt_len=st.integers(1, 12),
        max_tokens=st.integers(1, 8),
    )
    def contend(self, heavy, light, count, prompt_len, max_tokens):
        """A burst in one lane from two tenants, one sending `count` times the other's
        requests: what fair share is for."""
        for i in range(count + 1):
            tenant = light if i == count // 2 else heavy
            self.num_added += 1
            request = Request(
                f"r{self.num_added}",
                [3 + (self.num_added + j) % 9 for j in range(prompt_len)],
                stop=StopConditions(max_tokens, 0, frozenset({EOS})),
                arrival_time=self.now,
                lane="batch",
                tenant=tenant,
            )
            fits = prompt_len + max_tokens <= self.config.max_model_len
            if not fits or len(self.scheduler.waiting) >= self.config.max_waiting_requests:
                with pytest.raises(RequestRejected):
                    self.scheduler.add_request(request)
                continue
            self.scheduler.add_request(request)
            self.live[request.request_id] = request

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
        self._step(
            lambda: EOS if data.draw(st.floats(0, 1)) < eos_probability else 7,
            lambda num_drafts: data.draw(st.integers(0, num_drafts)),
        )

    @rule()
    def drain(self):
        """With no new arrivals, everything admitted finishes within a bound."""
        work = sum(r.num_prompt_tokens + r.stop.max_tokens for r in self.live.values())
        bound = work * (len(self.live) + 1) + 50
        for _ in range(bound):
            if not self.live:
                break
            self._step(lambda: 7, lambda num_drafts: num_drafts)
        assert not self.live, f"{len(self.live)} requests left after {bound} steps"
        assert not self.scheduler.has_unfinished_requests()
        assert free_block_ids(self.manager) == set(range(1, self.manager.num_blocks))
        assert not any(self.manager.ref_counts)

    def teardown(self):
        if hasattr(self, "scheduler"):
            self.drain()

    # ---- one step, checked -----------------------------------------------------------------

    def _step(self, next_token, accept):
        now = self.now
        plan = self.scheduler.schedule(now)
        self._note_outstanding()  # before the step's service is charged
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
        accepted = {seq.request_id: accept(seq.num_drafts) for seq in plan.seqs if seq.num_drafts}
        for request in self.scheduler.update_from_output(plan, sampled, accepted):
            assert request.finish_reason in ("stop", "length")
            if request.finish_reason == "stop":
                assert request.output_token_ids[-1] == EOS
                assert request.num_output_tokens >= request.stop.min_tokens
            else:
                assert request.num_output_tokens == request.stop.max_tokens
            self._report(request.request_id)
        self._check_fair_share()

    def _report(self, request_id):
        assert request_id not in self.reported, f"{request_id} reported finished twice"
        self.reported.add(request_id)
        del self.live[request_id]

    def _check_plan(self, plan):
        seqs = plan.seqs
        assert plan.num_batched_tokens == sum(s.num_tokens for s in seqs)
        assert plan.num_batched_tokens <= self.config.max_num_batched_tokens
        assert plan.num_rows <= self.config.max_num_seqs  # rows of logits
        assert plan.num_rows == sum(s.num_rows for s in seqs)
        assert plan.num_drafts == sum(s.num_drafts for s in seqs)
        assert plan.num_prompt_rows == sum(s.num_tokens - 1 for s in seqs if s.every_row)
        assert len({s.request_id for s in seqs}) == len(seqs)
        assert all(s.num_tokens == 1 + s.num_drafts and s.sample for s in seqs[: plan.num_decodes])
        assert not any(s.num_drafts for s in seqs[plan.num_decodes :])
        for request_id in plan.preempted_ids:
            request = self.live[request_id]
            assert request.status is RequestStatus.PREEMPTED and not request.block_ids
        writes = []
        for seq in seqs:
            request = self.live[seq.request_id]
            assert request.status is RequestStatus.RUNNING
            assert seq.num_tokens >= 1
            assert not self.config.long_prefill_token_threshold or (  # drafts are no prefill
                seq.num_tokens - seq.num_drafts <= max(1, self.config.long_prefill_token_threshold)
            )
            end = seq.start_pos + seq.num_tokens
            known = end - seq.num_drafts  # drafts are not among the request's tokens
            assert not seq.num_drafts or request.can_speculate
            assert end == request.num_computed_tokens  # planned counts as computed
            assert end <= self.config.max_model_len
            assert known + seq.num_drafts <= request.num_prompt_tokens + request.stop.max_tokens
            assert list(seq.token_ids[: seq.num_tokens - seq.num_drafts]) == list(
                request.all_token_ids[seq.start_pos : known]
            )
            assert seq.sample == (known == request.num_tokens)
            # Every chunk of a prompt_rows request's prompt has its rows (but the last prompt
            # token alone, decoded in pass (a), which needs none), from position 0 (no cached
            # prefix: nobody computed its rows) unless forked from its group.
            pending = seq.request_id in self.rows_pending
            last_alone = seq.sample and seq.num_tokens - seq.num_drafts == 1
            assert pending if seq.every_row else not pending or last_alone
            assert not seq.every_row or request.group_id or request.num_cached_tokens == 0
            if seq.sample:
                self.rows_pending.discard(seq.request_id)
            assert seq.block_ids is request.block_ids
            assert len(seq.block_ids) == -(-end // self.block_size)
            assert SINK_BLOCK_ID not in seq.block_ids
            keys = self._prefix_keys([*request.all_token_ids[: seq.start_pos], *seq.token_ids])
            for position in range(end):
                block = seq.block_ids[position // self.block_size]
                slot = position % self.block_size
                if position < seq.start_pos:  # reads: must be this request's own prefix
                    assert self.shadow[block][slot] == keys[position], (seq, position)
                else:
                    # A written block is in the prefix cache only if this step fills it
                    # (planning indexes the blocks its step completes), so no earlier plan
                    # could have handed it to a reader.
                    full = (position // self.block_size + 1) * self.block_size <= end
                    writes.append((block, slot, keys[position], full))
        cache = self.manager.prefix_cache
        for block, slot, key, full in writes:
            assert self.manager.ref_counts[block] == 1  # written blocks are private
            assert cache is None or full or not cache.is_cached(block)
            self.shadow.setdefault(block, [None] * self.block_size)[slot] = key

    @staticmethod
    def _prefix_keys(tokens):
        keys = []
        key = hash("root")
        for token in tokens:
            key = hash((key, token))
            keys.append(key)
        return keys

    def _check_fair_share(self):
        """Called after every step and rule. While tenants f and g are both backlogged in a
        lane, f is admitted only when its counter (with what the step scheduled so far) is
        the lowest, so its service beyond g's since both became backlogged is at most what its
        admitted requests could still be served (the most seen after a schedule(), before the
        step's service is charged) plus the counter gap they started with
        (jserve.core.fairness derives the bound)."""
        if not self.check_fairness:
            return
        fair = self.scheduler.fair
        self._note_outstanding()
        for lane in LANES:
            backlogged = set(self.scheduler.waiting.tenant_queues(lane))
            starts = self.gap_starts[lane]
            for pair in [p for p in starts if not set(p) <= backlogged]:
                del starts[pair]
            for f in sorted(backlogged):
                for g in sorted(backlogged):
                    if f < g and (f, g) not in starts:
                        starts[(f, g)] = [fair.level(lane, f), fair.level(lane, g), 0.0, 0.0]
            for (f, g), start in starts.items():
                f0, g0, most_f, most_g = start
                gap = (fair.level(lane, f) - f0) - (fair.level(lane, g) - g0)
                slack = abs(f0 - g0) + 1e-6
                assert -most_g - slack <= gap <= most_f + slack, (lane, f, g, gap, start)
                assert max(most_f, most_g) <= max(self.gap_bound.values())  # the docs' B
                self.gaps_checked += gap != 0

    def _note_outstanding(self):
        """Raise each backlogged pair's record of the most service each tenant's admitted,
        unfinished requests in the lane can still get."""
        if not self.check_fairness:
            return
        fair = self.scheduler.fair
        for lane, starts in self.gap_starts.items():
            if not starts:
                continue
            out = {}
            for request in self.live.values():
                admitted = (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
                if request.lane != lane or request.status not in admitted:
                    continue
                prompt = request.num_prompt_tokens - request.num_prompt_served
                outputs = request.stop.max_tokens - request.num_output_tokens
                cost = fair.cost(request.tenant, prompt, outputs)
                out[request.tenant] = out.get(request.tenant, 0.0) + cost
            for (f, g), start in starts.items():
                start[2] = max(start[2], out.get(f, 0.0))
                start[3] = max(start[3], out.get(g, 0.0))

    # ---- invariants ------------------------------------------------------------------------

    @invariant()
    def fair_share_gap_is_bounded(self):
        if hasattr(self, "scheduler"):
            self._check_fair_share()

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
        free = free_block_ids(manager)
        referenced = {b for b, count in enumerate(held) if count}
        assert not free & referenced
        assert free | referenced == set(range(1, manager.num_blocks))
        assert SINK_BLOCK_ID not in free and held[SINK_BLOCK_ID] == 0
        if manager.prefix_cache is not None:
            cached = set(manager.prefix_cache._hash_of_block)
            assert set(manager.prefix_cache._evictable) == cached - referenced

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


def test_scheduler_state_machine():
    run_state_machine_as_test(SchedulerMachine, settings=examples(150, stateful_step_count=50))


@pytest.mark.slow
def test_scheduler_state_machine_long():
    """The thorough budget, longer runs: test_scheduler_state_machine runs the same machine
    by default."""
    budget = examples(200, THOROUGH, stateful_step_count=80)
    run_state_machine_as_test(SchedulerMachine, settings=budget)
