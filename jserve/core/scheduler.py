"""Iteration-level scheduler: which tokens of which requests the next step computes.

One iteration, as the engine drives it:
1. `schedule()` may change everything here: it ends requests past their deadline (see
   `deadlines`), has `planner.plan_step` build a `StepPlan` (decodes, then prefill chunks,
   then admissions, preempting by recompute when blocks run out: the passes are described
   there), and applies what the planner decided to the running list and waiting queues. This
   class is the only one that changes them, so it alone keeps running sorted by rank.
   Planning counts the plan's chunks as computed and the tokens it samples as pending
   (`Request.num_pending`), and indexes the full blocks of known tokens it computes.
2. The runtime computes the plan. Meanwhile `add_request`, `abort` and `finish_request` may be
   called; the next `update_from_output` skips requests they ended. Requests ended by a caller
   are not reported back to it; `StepPlan.finished` lists only those the scheduler ended by
   itself.
3. `update_from_output()` appends the sampled tokens (no longer pending) and finishes requests
   on a stop token or max_tokens (the rules: jserve.core.stopping), returning those it
   finished.
Synchronously, `schedule()` and `update_from_output()` alternate. With async scheduling the
engine plans step N+1 while step N runs, before N's tokens are known: one plan may be in flight
(scheduled, not yet updated) when `schedule()` is called, never two. Step N+1 then decodes each
pending token with a placeholder id (the engine writes the real one in before dispatch), a
request N finishes wastes its row of N+1, and a request that N+1's plan preempts still gets its
token of N. Plans are updated in the order they were made. Nothing here is thread-safe: call
every method from the thread that drives the steps (e.g. the engine's event loop).
"""

from __future__ import annotations

import logging
import time
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

from jserve.config.scheduler import CacheConfig, Lane, SchedulerConfig
from jserve.config.settings import InvalidSetting
from jserve.config.speculative import SpeculativeConfig, parse_speculative_config
from jserve.core.admission import (
    check_deadline,
    check_kv_usage,
    check_new_request,
    estimate_finish,
)
from jserve.core.block_manager import BlockManager
from jserve.core.deadlines import DeadlineHeap
from jserve.core.drafting import DraftProposer, make_proposer
from jserve.core.fairness import FairShare
from jserve.core.ngram import note_acceptance
from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.core.planner import Drafting, PlanOutcome, plan_step
from jserve.core.queues import WaitingQueues
from jserve.core.request import LANE_RANK, Request, RequestStatus
from jserve.core.step_costs import StepCosts
from jserve.core.tenants import TenantPolicy
from jserve.kv_events.records import KVCacheEvent
from jserve.outputs import FinishReason

_rank = attrgetter("rank")
# The decision log: why each request was admitted, deferred, preempted or rejected (DEBUG;
# switched on at run time through jserve.core.control).
DECISIONS = logging.getLogger("jserve.decisions")


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of usable blocks referenced by requests
    num_free_blocks: int  # free or evictable
    prefix_cache_queries: int  # tokens looked up at admission
    prefix_cache_hits: int  # of those, tokens found cached
    num_preemptions: int


class Scheduler:
    """See the module docstring. `tenants` gives tenants' weights and caps (fair share:
    jserve.core.fairness); `step_costs`, the measured per-bucket step times that deadline
    admission and `target_itl_ms` price steps with (without it, neither is active)."""

    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        tenants: TenantPolicy | None = None,
        step_costs: StepCosts | None = None,
    ) -> None:
        self.cache_config = cache_config
        self.block_size = cache_config.block_size
        self.num_blocks = cache_config.num_blocks
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, scheduler_config.enable_prefix_caching
        )
        self._spec: SpeculativeConfig | None = None
        self.proposer: DraftProposer | None = None  # made for the first speculative config
        self.reconfigure(scheduler_config)
        self.fair = FairShare(tenants or TenantPolicy())
        self.step_costs = step_costs
        self.running: list[Request] = []  # sorted by Request.rank, highest first
        self.waiting = WaitingQueues(scheduler_config.aging_iterations)
        self._deadlines = DeadlineHeap()
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}  # every unfinished request
        self.group_leaders: dict[str, Request] = {}  # group_id -> the member that prefills
        self._num_added = 0
        self.num_steps = 0  # schedule() calls so far; waiting ages are counted in steps
        self._plans_in_flight = 0  # non-empty plans not yet updated: 0 or 1 between calls

    def reconfigure(self, config: SchedulerConfig) -> None:
        """Adopt `config` (at start-up, or between steps from the admin endpoint); a
        ValueError (an InvalidSetting naming the setting) leaves the old one. Prefix caching,
        chunked prefill and max_model_len cannot change here."""
        old = getattr(self, "config", None)
        if old is not None:
            for name in ("enable_prefix_caching", "max_model_len", "enable_chunked_prefill"):
                if getattr(config, name) != getattr(old, name):
                    raise InvalidSetting(name, f"{name} cannot change at run time")
        usable = self.block_manager.num_usable_blocks
        watermark_blocks = int(config.free_block_watermark * usable)
        blocks_per_seq = -(-config.max_model_len // self.block_size)
        if blocks_per_seq + watermark_blocks > usable:
            raise InvalidSetting(
                "free_block_watermark" if watermark_blocks else "max_model_len",
                f"num_blocks={self.num_blocks} leaves {usable} usable blocks, but one "
                f"request of max_model_len={config.max_model_len} needs "
                f"{blocks_per_seq} blocks of {self.block_size} tokens plus "
                f"{watermark_blocks} watermark blocks; raise num_blocks, or lower "
                f"max_model_len or free_block_watermark",
            )
        self.config = config
        self.watermark_blocks = watermark_blocks
        # Parsed here, not read from the config's cached property: reconfigure must leave a
        # config's attributes as its caller made them.
        spec = parse_speculative_config(config.speculative_config)
        # A proposer lives as long as its settings (a suffix proposer keeps recent outputs):
        # switching speculation off and on again with the same settings keeps it.
        if spec is not None and spec != self._spec:
            self._spec, self.proposer = spec, make_proposer(spec)
        if old is not None:
            self.waiting.aging_iterations = config.aging_iterations

    def fresh(self) -> Scheduler:
        """A new, empty scheduler like this one: the same settings (as adjusted at run time),
        pool shape, tenants' policy and step costs, recording KV events if this one does. For
        when the KV pool this one described is lost (jserve.engine.llm_engine's recover)."""
        scheduler = Scheduler(self.config, self.cache_config, self.fair.policy, self.step_costs)
        if self.block_manager.records_kv_events:
            scheduler.record_kv_events()
        return scheduler

    # ---- the KV pool, as the engine sees it -------------------------------------------------

    @property
    def num_usable_blocks(self) -> int:
        """KV blocks requests can hold (all but the padding sink)."""
        return self.block_manager.num_usable_blocks

    def record_kv_events(self) -> None:
        """From now on, log every change of the prefix cache (see take_kv_events)."""
        self.block_manager.record_kv_events()

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What the prefix cache stored and evicted since the last call, oldest first."""
        return self.block_manager.take_kv_events()

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request, now: float | None = None) -> None:
        """Queue `request`, or raise RequestRejected ("invalid", "too_long", "queue_full",
        "kv_full", "deadline": jserve.core.admission; `now` on the deadline's clock).

        An "interactive" prompt longer than `long_prompt_threshold` moves to the "long" lane.
        Siblings of an `n > 1` group (same `group_id` and prompt, added right after the first
        member) count against the queue cap like any sequence (the engine adds all members or
        none); they wait until the first member's prompt is computed, then share its full
        prompt blocks.
        """
        is_sibling = request.group_id is not None and request.group_id in self.group_leaders
        try:
            check_new_request(request, self.config, len(self.waiting))
            check_kv_usage(self.block_manager.usage(), self.config)
            request.lane = Lane(request.lane)  # a known lane: check_new_request checked it
            if request.lane is Lane.INTERACTIVE and (
                request.num_prompt_tokens > self.config.long_prompt_threshold
            ):
                request.lane = Lane.LONG
            if (
                request.deadline is not None
                and self.config.deadline_admission
                and self.step_costs is not None
                and not is_sibling
            ):
                estimate = estimate_finish(
                    request, self.config, self.step_costs, self.running, self.waiting,
                    self.step_budget(),
                )  # fmt: skip
                check_deadline(request, estimate, time.monotonic() if now is None else now)
        except Exception as exc:
            request.status = RequestStatus.FINISHED
            if DECISIONS.isEnabledFor(logging.DEBUG):
                DECISIONS.debug(
                    "reject %s tenant=%s lane=%s reason=%s: %s", request.request_id,
                    request.tenant, request.lane, getattr(exc, "reason", "error"), exc,
                )  # fmt: skip
            raise
        self._num_added += 1
        request.rank = (LANE_RANK[request.lane], request.arrival_time, self._num_added)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        if request.group_id is not None and not is_sibling:
            self.group_leaders[request.group_id] = request
        self.waiting.push_back(request, self.num_steps)
        self._deadlines.push(request, len(self._requests))
        self.fair.on_add(request)

    def abort(self, request_id: str) -> bool:
        """End a request in any state and free its blocks now; False if it is unknown."""
        return self.finish_request(request_id, FinishReason.ABORT)

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """End a request the caller found finished (a stop string, an abort) and free its
        blocks now; False if unknown. Not reported back in a plan: the caller knows."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._remove_and_finish(request, reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def stats(self) -> SchedulerStats:
        cache = self.block_manager.prefix_cache
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.block_manager.usage(),
            num_free_blocks=self.block_manager.num_free_blocks,
            prefix_cache_queries=cache.queries if cache else 0,
            prefix_cache_hits=cache.hits if cache else 0,
            num_preemptions=self.num_preemptions,
        )

    # ---- one iteration ---------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepPlan:
        """Plan the next step (`now` on the time.monotonic() clock, for deadlines); at most
        one earlier plan may still wait for its `update_from_output`."""
        if self._plans_in_flight > 1:
            raise RuntimeError(
                "schedule() with two plans not yet updated: call update_from_output() for the "
                "older one first (one step may be in flight while the next is planned, not two)"
            )
        self.num_steps += 1
        finished = {}
        for request in self._deadlines.pop_expired(time.monotonic() if now is None else now):
            self._remove_and_finish(request, FinishReason.TIMEOUT)
            finished[request.request_id] = FinishReason.TIMEOUT
        outcome = plan_step(
            self.config, self.block_manager, self.running, self.waiting, self.group_leaders,
            self.watermark_blocks, self.num_steps, self.fair, self.step_budget(),
            None if self.proposer is None else Drafting(self.proposer, self.step_costs),
        )  # fmt: skip
        self._apply(outcome)
        plan = outcome.plan
        self._commit(plan)
        if DECISIONS.isEnabledFor(logging.DEBUG):
            self._log_decisions(outcome, finished)
        plan.finished = finished
        return plan

    def _commit(self, plan: StepPlan) -> None:
        """Count the planned chunks as computed and their sampled tokens as pending (the next
        plan builds on this step, which runs first), and index the full blocks of known tokens
        it computes (see BlockManager.cache_full_blocks): a block ending in a pending token is
        indexed by a later plan, once the token is known. A request's `prompt_rows` ends with
        its prompt: a recompute after preemption needs no rows."""
        if plan.seqs:
            self._plans_in_flight += 1
        requests, block_manager, block_size = self._requests, self.block_manager, self.block_size
        caching = block_manager.prefix_cache is not None
        for seq in plan.seqs:
            request = requests[seq.request_id]
            end = request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if seq.sample:
                request.num_pending += 1
                request.prompt_rows = False  # its prompt's rows are all planned
            if caching:  # drafts are not known tokens: only accepted ones are ever hashed
                known = min(end, len(request.all_token_ids))
                if known // block_size > request.num_hashed_blocks:
                    block_manager.cache_full_blocks(request, known)

    def _log_decisions(self, outcome: PlanOutcome, finished: Mapping[str, FinishReason]) -> None:
        level = self.fair.level
        for request_id in finished:
            DECISIONS.debug("expire %s: past its deadline", request_id)
        for r in outcome.admitted:
            DECISIONS.debug(
                "admit %s tenant=%s lane=%s counter=%.1f computed=%d", r.request_id, r.tenant,
                r.lane, level(r.lane, r.tenant), r.num_computed_tokens,
            )  # fmt: skip
        for r in outcome.preempted:
            DECISIONS.debug(
                "preempt %s tenant=%s lane=%s counter=%.1f: out of KV blocks", r.request_id,
                r.tenant, r.lane, level(r.lane, r.tenant),
            )  # fmt: skip
        if outcome.deferred is not None:
            DECISIONS.debug("defer %d waiting: %s", len(self.waiting), outcome.deferred)

    def step_budget(self) -> int:
        """Tokens the next step may take: max_num_batched_tokens, or with target_itl_ms the
        largest token bucket whose measured step time fits the target; at least one token
        per running decode (the admin endpoint may lower the budget below the running count)."""
        config = self.config
        budget = config.max_num_batched_tokens
        if config.target_itl_ms and self.step_costs is not None:
            num_seqs = min(config.max_num_seqs, len(self.running) + len(self.waiting))
            target = config.target_itl_ms / 1000.0
            budget = min(self.step_costs.largest_within(target, max(1, num_seqs)) or 0, budget)
        return max(budget, len(self.running), 1)

    def _apply(self, outcome: PlanOutcome) -> None:
        """Move what the planner admitted and preempted between waiting and running."""
        fair = self.fair
        for request in outcome.admitted:
            self.waiting.admit(request, self.num_steps)
            request.status = RequestStatus.RUNNING
            fair.on_start_running(request)
            if request.num_preemptions == 0:
                request.num_cached_tokens = request.num_computed_tokens
        for victim in outcome.preempted:  # its blocks are already free
            fair.on_preempted(victim)
            victim.status = RequestStatus.PREEMPTED
            victim.num_computed_tokens = 0
            victim.num_preemptions += 1
            self.waiting.push_front(victim, self.num_steps)
        self.num_preemptions += len(outcome.preempted)
        self.running = outcome.running

    def update_from_output(
        self,
        plan: StepPlan,
        sampled: Mapping[str, int],
        num_accepted: Mapping[str, int] | None = None,
    ) -> list[Request]:
        """Record that `plan` ran; `sampled` maps request id -> new token for seqs with
        `sample`. Returns the requests this finished (a stop token or max_tokens, decided by
        jserve.core.stopping; the caller applies the stop-string rule and calls finish_request).
        A request the next plan preempted (async scheduling) keeps its token, to recompute.

        A seq with drafts keeps the first `num_accepted[request id]` of them (0 if absent),
        then the sampled token, each checked by the stop rules in turn; the rest are rolled
        back (their KV slots are free to overwrite, blocks past the tokens are freed)."""
        if plan.seqs:
            self._plans_in_flight -= 1
        requests = self._requests
        running = RequestStatus.RUNNING
        charge = self.fair.charge
        decodes: dict[tuple[str, str], int] = {}  # (lane, tenant) -> one-token decodes
        finished = []
        # The hot loop of every step: attribute access and calls are kept to a minimum.
        for seq in plan.seqs:
            request = requests.get(seq.request_id)
            if request is None:
                continue  # aborted or finished by the engine while the step ran
            start = seq.start_pos
            if seq.num_drafts:  # never with async scheduling (EngineArgs refuses both)
                request.num_pending -= 1
                if self._accept_drafts(request, seq, sampled, num_accepted or {}, decodes):
                    finished.append(request)
                continue
            if start < request.num_prompt_tokens or not seq.sample:
                charge(request, start, start + len(seq.token_ids), seq.sample)
            else:  # a decode (or a recompute of outputs): one output token served
                key = (request.lane, request.tenant)
                decodes[key] = decodes.get(key, 0) + 1
            if not seq.sample:
                continue
            request.num_pending -= 1
            output = request.output_token_ids
            token_id = _sampled_token(sampled, seq.request_id)
            output.append(token_id)
            request.all_token_ids.append(token_id)
            reason = request.stop.after_token(token_id, len(output))
            if reason is not None:
                if request.status is running:
                    self._finish(request, reason)  # taken out of running below, all at once
                else:  # preempted by the plan made while this step ran
                    self._remove_and_finish(request, reason)
                finished.append(request)
        self.fair.charge_decodes(decodes)
        if finished:
            self.running = [r for r in self.running if r.status is running]
        return finished

    def _accept_drafts(
        self,
        request: Request,
        seq: ScheduledSeq,
        sampled: Mapping[str, int],
        num_accepted: Mapping[str, int],
        decodes: dict[tuple[str, str], int],
    ) -> bool:
        """Keep a decode's accepted drafts and its sampled token (stopping at the first
        token the stop rules end it on), roll the rest back; True if it finished."""
        accepted = num_accepted.get(seq.request_id, 0)
        if not 0 <= accepted <= seq.num_drafts:
            raise ValueError(
                f"{accepted} drafts accepted for request {seq.request_id!r}, which had "
                f"{seq.num_drafts}"
            )
        tokens = [*seq.token_ids[1 : 1 + accepted], _sampled_token(sampled, seq.request_id)]
        # The decode token and the accepted drafts were computed after the right tokens.
        request.num_computed_tokens = seq.start_pos + 1 + accepted
        acceptance, kind = request.draft_acceptance, request.draft_kind
        acceptance[kind] = note_acceptance(acceptance[kind], seq.num_drafts, accepted)
        output = request.output_token_ids
        key = (request.lane, request.tenant)
        decodes[key] = decodes.get(key, 0) + len(tokens)
        for token_id in tokens:
            output.append(token_id)
            request.all_token_ids.append(token_id)
            reason = request.stop.after_token(token_id, len(output))
            if reason is not None:
                self._finish(request, reason)
                return True
        self.block_manager.truncate(request, -(-request.num_tokens // self.block_size))
        return False

    # ---- removal -----------------------------------------------------------------------

    def _remove_and_finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            index = bisect_left(self.running, request.rank, key=_rank)
            del self.running[index]
        else:
            self.waiting.remove(request)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Free and forget `request` (the caller already took it out of running/waiting)."""
        self.block_manager.free(request)
        self.fair.on_finish(request, request.status is RequestStatus.RUNNING)
        if self.proposer is not None:
            self.proposer.on_finish(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        if request.group_id is not None and self.group_leaders.get(request.group_id) is request:
            del self.group_leaders[request.group_id]


def _sampled_token(sampled: Mapping[str, int], request_id: str) -> int:
    try:
        return sampled[request_id]
    except KeyError:
        raise ValueError(
            f"no sampled token for request {request_id!r}, whose chunk had sample=True; pass "
            f"one token for every such seq of the plan"
        ) from None
