"""The three passes that turn the scheduler's queues into one StepPlan, as one function.

Over one step's token budget:
a. running decodes, one token each, in rank order (lane, then arrival);
b. running prefills (chunked prompts, recomputes after preemption), in rank order;
c. unless (a) or (b) preempted, waiting requests: one from each lane that aging says is
   starved (jserve.core.queues), then lane by lane in strict priority order, each
   admitted with its cached prefix and a first chunk while sequences, budget and free blocks
   above the watermark allow. A request whose next blocks a running prefill is computing
   right now (the same prefix, not cached yet) waits for them rather than computing them a
   second time (SGLang's in-batch prefix check). Inside a lane: preempted requests first,
   then by fair share between tenants (the least-served backlogged tenant's oldest request:
   jserve.core.fairness) or, with fairness="fcfs", FIFO. Tenants at their `max_running` cap
   wait. With scheduling="static", (c) is replaced by admitting a whole batch only when
   nothing runs;
d. with speculative decoding, draft tokens (jserve.core.drafting's proposer) after the
   decodes of requests that may speculate, in rank order, from what (a)-(c) left: token
   budget, logit rows (one per draft, within the largest sequence bucket, max_num_seqs) and
   free blocks above the watermark, as many as raise the step's expected tokens per second
   under the measured step costs and the sequence's acceptance
   (jserve.core.drafting.num_drafts_that_pay; without measured costs, jserve.core.ngram's
   acceptance floor decides instead whether a sequence drafts), none
   while `disable_by_batch_size` sequences or more run. Drafts never preempt, defer or
   displace other work.
A request with `prompt_rows` (prompt logprobs, mean pooling) takes a row of logits per
prompt token it computes: its chunk is bounded by the rows left (each running request keeps
one), and it is admitted without its cached prefix.
When a running request cannot get a block, a request of the lowest running lane is preempted:
the most-served tenant's latest one (fcfs: the latest arrival). Its blocks are freed and it
goes back to the front of its lane with every token kept, to recompute them (cheaply, with
prefix caching). The step's token budget is `budget` (the scheduler's adaptive choice, or
max_num_batched_tokens).

With async scheduling a step is planned while the previous one runs: a request that step
samples has a pending token (`Request.num_pending`) and decodes it with a placeholder id. A
victim with a pending token keeps it (the scheduler appends it when it arrives), and cannot be
admitted again before that: a step that preempts admits no one, and the next plan comes after
the previous step's update.

`plan_step` reads the scheduler's running list and waiting queues and returns what it decided
(`PlanOutcome`): the plan, the new running list, and which requests it admitted and preempted.
It never changes the scheduler's containers; the scheduler applies the outcome, so the
invariants of running and waiting are kept in one place. What it does change, and why it must:
block tables through the block manager (a preempted request's blocks are what the next
allocation takes, so they are freed as the pass goes), and the draft acceptance average of a
sequence pass (d) pauses, which each paused step raises (jserve.core.ngram).
"""

from __future__ import annotations

from array import array
from bisect import bisect_left, insort
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from operator import attrgetter

from jserve.config.scheduler import FairnessPolicy, Lane, SchedulerConfig, SchedulingPolicy
from jserve.config.speculative import SpeculativeConfig
from jserve.core.block_manager import BlockManager
from jserve.core.drafting import DraftProposer, num_drafts_that_pay
from jserve.core.fairness import FairShare, service_of
from jserve.core.ngram import RETRY_STEP, drafts_pay
from jserve.core.plan import PLACEHOLDER_TOKEN, ScheduledSeq, StepPlan
from jserve.core.queues import WaitingQueues
from jserve.core.request import LANE_RANK, Request, RequestStatus
from jserve.core.step_costs import StepCosts

_rank = attrgetter("rank")
# The input of every decode whose token is pending; shared and never written (the engine
# writes the real id into the step's input buffer).
_PLACEHOLDER = array("q", (PLACEHOLDER_TOKEN,))


class _Verdict(StrEnum):
    """What an admission attempt decided for the rest of its lane and step."""

    ADMITTED = "admitted"
    SKIP = "skip"  # not now (a sibling waiting for its group's prefill, a prefix in flight)
    CAPPED = "capped"  # its tenant runs its max_running sequences
    NEXT_LANE = "next_lane"  # the long lane's share is used up
    STOP = "stop"  # no more admissions this step


_KEEP_GOING = (_Verdict.ADMITTED, _Verdict.SKIP, _Verdict.CAPPED)  # a lane's next may go
# A waiting request defers for a prefix in flight only if at least this many of its next
# blocks are being computed: for a shorter shared span, waiting a step costs more than it saves.
IN_FLIGHT_MIN_BLOCKS = 2


class Deferral(StrEnum):
    """Why a waiting request was not admitted this step (the decision log says it)."""

    MAX_NUM_SEQS = "max_num_seqs"
    TOKEN_BUDGET = "token_budget"
    KV_WATERMARK = "kv_watermark"
    LONG_LANE_SHARE = "long_lane_share"
    TENANT_CAP = "tenant_cap"
    PREFIX_IN_FLIGHT = "prefix_in_flight"
    PREEMPTING = "preempting"  # blocks ran out this step


@dataclass(frozen=True)
class Drafting:
    """What pass (d) drafts with: the scheduler's proposer, and the measured step costs that
    say whether drafts pay (None: not measured, every draft is taken)."""

    proposer: DraftProposer
    costs: StepCosts | None


@dataclass
class PlanOutcome:
    """What one `plan_step` decided; the scheduler applies it."""

    plan: StepPlan
    running: list[Request]  # the new running list, sorted by Request.rank
    admitted: list[Request] = field(default_factory=list)  # left waiting, in admission order
    # Lost their blocks, in preemption order; they go back to the front of their lane, tokens
    # kept (a request admitted by the static policy may be admitted and preempted in one step).
    preempted: list[Request] = field(default_factory=list)
    # Why the last waiting request considered was not admitted, for the decision log; None if
    # nothing was deferred.
    deferred: Deferral | None = None


def plan_step(
    config: SchedulerConfig,
    block_manager: BlockManager,
    running: Sequence[Request],
    waiting: WaitingQueues,
    group_leaders: Mapping[str, Request],
    watermark_blocks: int,
    step: int,
    fair: FairShare,
    budget: int,
    drafting: Drafting | None = None,
) -> PlanOutcome:
    """Plan iteration `step` with the passes above; `running` is sorted by rank; `drafting`
    is needed for pass (d) (with speculative decoding configured)."""
    return _Planner(
        config, block_manager, running, waiting, group_leaders, watermark_blocks, step, fair,
        budget, drafting,
    ).build()  # fmt: skip


class _Planner:
    """One `plan_step` call's state: token budget left, long-lane tokens used, seqs so far."""

    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        running: Sequence[Request],
        waiting: WaitingQueues,
        group_leaders: Mapping[str, Request],
        watermark_blocks: int,
        step: int,
        fair: FairShare,
        budget: int,
        drafting: Drafting | None,
    ) -> None:
        self.config = config
        self.drafting = drafting
        self.fair = fair
        self.vtc = config.fairness is FairnessPolicy.VTC
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting = waiting
        self.group_leaders = group_leaders
        self.watermark_blocks = watermark_blocks
        self.step = step
        self.outcome = PlanOutcome(StepPlan(), list(running))
        self.running = self.outcome.running
        self.step_budget = self.budget = budget
        self.long_used = 0
        self._long_cap: int | None = None
        self.decodes: list[ScheduledSeq] = []
        self.prefills: list[ScheduledSeq] = []
        self.extra_rows = 0  # rows of `every_row` chunks beyond one each (plan.num_prompt_rows)
        self.unfinished_prefills: list[Request] = []  # running, short of their known tokens
        # Decodes that may take drafts in pass (d), with their seqs, in rank order.
        self.draftable: list[tuple[Request, ScheduledSeq]] = []
        self.preempted: set[str] = set()
        # (lane, tenant) -> counter units this step has scheduled so far, so admissions and
        # victims see them; built on first use (most steps admit no one and preempt no one).
        self._pending: dict[tuple[str, str], float] | None = None
        self._extra_running: dict[str, int] | None = None  # tenant -> net admissions, for caps
        # Keys of the blocks running prefills will compute and cache; built on first use, then
        # grown by each admission.
        self._in_flight: set[bytes] | None = None
        self._lane_quota: int | None = None  # admissions `_admit_lane` may still make
        self._promoted: set[str] = set()  # ids admitted ahead of lane order by aging

    def build(self) -> PlanOutcome:
        static = self.config.scheduling is SchedulingPolicy.STATIC
        if static and not self.running:
            self.admit_static_batch()
        self.schedule_running_decodes()
        self.schedule_running_prefills()
        if not static and not self.preempted:
            # Blocks ran out this step: admitting now would only set up the next preemption.
            self.admit_waiting()
        elif self.preempted and len(self.waiting):
            self.outcome.deferred = Deferral.PREEMPTING
        plan = self.outcome.plan
        if self.draftable and self.drafting is not None and self.config.speculative is not None:
            spec = self.config.speculative
            limit = spec.disable_by_batch_size
            if limit is None or len(self.running) < limit:
                plan.num_drafts = self.add_drafts(spec, self.drafting)
        plan.seqs = self.decodes + self.prefills
        plan.num_decodes = len(self.decodes)
        plan.num_prompt_rows = self.extra_rows
        plan.num_batched_tokens = self.step_budget - self.budget
        plan.preempted_ids = [request.request_id for request in self.outcome.preempted]
        return self.outcome

    # ---- the passes ------------------------------------------------------------------------

    def schedule_running_decodes(self) -> None:
        """(a) One token for every running request that has exactly one uncomputed token;
        notes the others (prefilling) for pass (b)."""
        block_size = self.block_size
        decodes = self.decodes
        unfinished_prefills = self.unfinished_prefills
        preempted = self.preempted
        for request in list(self.running):
            if preempted and request.request_id in preempted:
                continue  # a victim of an earlier request of this pass
            start = request.num_computed_tokens
            pending = request.num_pending
            if len(request.all_token_ids) + pending - start != 1:
                unfinished_prefills.append(request)
                continue
            if start >= len(request.block_ids) * block_size and not self._grow_or_preempt(
                request, 1
            ):
                continue  # `request` itself was the victim
            self.budget -= 1
            seq = ScheduledSeq(
                request.request_id,
                start,
                _PLACEHOLDER if pending else request.all_token_ids[start:],
                request.block_ids,
                True,
                request.prompt_token_ids,
                request.output_token_ids,
            )
            decodes.append(seq)
            if request.can_speculate and not pending:
                self.draftable.append((request, seq))

    def schedule_running_prefills(self) -> None:
        """(b) The next chunk of every running request still short of its known tokens, in
        priority order (victims are taken from the tail of the running list as it goes)."""
        for request in self.unfinished_prefills:
            if self.budget == 0:
                return
            if request.request_id in self.preempted:
                continue  # preempted for an earlier one in this pass
            num_new = self._chunk_size(request, request.num_tokens - request.num_computed_tokens)
            if num_new and self.config.enable_chunked_prefill:
                # Take what free blocks hold rather than preempting someone for the rest;
                # preempt only when not even one more token fits.
                fits = (
                    len(request.block_ids) + self.block_manager.num_free_blocks
                ) * self.block_size - request.num_computed_tokens
                if 0 < fits < num_new:
                    num_new = fits
            if num_new and self._grow_or_preempt(request, num_new):
                self._add_chunk(request, num_new)

    def add_drafts(self, spec: SpeculativeConfig, drafting: Drafting) -> int:
        """(d) Drafts for the decodes that may take them; returns how many were added."""
        rows = len(self.decodes) + len(self.prefills) + self.extra_rows
        rows_left = self.config.max_num_seqs - rows
        added = 0
        for request, seq in self.draftable:
            if self.budget <= 0 or rows_left <= 0:
                break
            if request.request_id in self.preempted:
                continue
            k = min(
                spec.num_speculative_tokens, self.budget, rows_left,
                request.stop.max_tokens - request.num_output_tokens - 1,  # the last is sampled
                self.config.max_model_len - request.num_tokens,
            )  # fmt: skip
            if k <= 0:
                continue
            drafts = drafting.proposer.propose(request, k)
            if not drafts.tokens:
                continue
            # Drafts are priced by the acceptance of their kind (guess or copy): against the
            # measured step costs, or without them by the acceptance floor.
            acceptance, kind = request.draft_acceptance, drafts.kind
            if drafting.costs is None and not drafts_pay(acceptance[kind]):
                k = 0
            else:
                tokens = self.step_budget - self.budget
                k = num_drafts_that_pay(
                    drafting.costs, tokens, rows + added, acceptance[kind], len(drafts.tokens)
                )
            if k == 0:  # too rarely accepted to pay now: it tries again after a while
                acceptance[kind] = min(1.0, acceptance[kind] + RETRY_STEP)
                continue
            k = self._draft_room(request, k)
            if k == 0:
                continue
            request.draft_kind = kind
            seq.token_ids = seq.token_ids + drafts.tokens[:k]
            seq.num_drafts = k
            self.budget -= k
            rows_left -= k
            added += k
        return added

    def _draft_room(self, request: Request, num_drafts: int) -> int:
        """How many of `num_drafts` drafts after `request`'s one decode token get KV slots:
        those its blocks hold, then blocks taken while the free ones stay above the watermark."""
        block_size = self.block_size
        held = len(request.block_ids) * block_size - request.num_computed_tokens - 1
        if num_drafts <= held:
            return num_drafts
        spare = self.block_manager.num_free_blocks - self.watermark_blocks
        num_drafts = min(num_drafts, held + max(0, spare) * block_size)
        self.block_manager.allocate(request, 1 + num_drafts)
        return num_drafts

    def admit_waiting(self) -> None:
        """(c) Waiting requests while room is left: one from each starved lane (aging), then
        lane by lane in strict order; inside a lane, preempted requests first, then fair share
        between tenants (or FIFO)."""
        for lane in self.waiting.starved_lanes(self.step):
            if self._admit_lane(lane, limit=1) is _Verdict.STOP:
                return
        self._promoted = {r.request_id for r in self.outcome.admitted}
        for lane in Lane:
            if self.waiting.queue(lane) and self._admit_lane(lane) is _Verdict.STOP:
                return

    def _admit_fifo(self, queue: Sequence[Request], skip_preempted: bool) -> _Verdict:
        """Admit from `queue` in order (preempted requests already tried, if skipped)."""
        for request in queue:
            if skip_preempted and request.status is RequestStatus.PREEMPTED:
                continue
            if not self._room():
                return _Verdict.STOP
            verdict = self._try_admit(request)
            if verdict not in _KEEP_GOING:
                return verdict
            if self._lane_quota_spent(verdict):
                return _Verdict.NEXT_LANE
        return _Verdict.NEXT_LANE

    def _room(self) -> bool:
        if len(self.running) + self.extra_rows >= self.config.max_num_seqs:
            self.outcome.deferred = Deferral.MAX_NUM_SEQS
            return False
        if self.budget <= 0:
            self.outcome.deferred = Deferral.TOKEN_BUDGET
            return False
        return True

    def _admit_lane(self, lane: Lane, limit: int | None = None) -> _Verdict:
        """Admit from one lane, at most `limit` requests: "stop" (no more admissions this
        step) or "next_lane"."""
        self._lane_quota = limit
        queue = self.waiting.queue(lane)
        if not self.vtc:
            return self._admit_fifo(queue, skip_preempted=False)
        for request in queue:  # preempted requests lead their lane: they were admitted first
            if request.status is not RequestStatus.PREEMPTED:
                break
            if not self._room():
                return _Verdict.STOP
            verdict = self._try_admit(request)
            if verdict not in _KEEP_GOING:
                return verdict
            if self._lane_quota_spent(verdict):
                return _Verdict.NEXT_LANE
        tenant_queues = self.waiting.tenant_queues(lane)
        if len(tenant_queues) == 1:  # one tenant: its FIFO is the lane's (counters moot)
            return self._admit_fifo(queue, skip_preempted=True)
        heads = {t: iter(q) for t, q in tenant_queues.items()}
        pending = self._pending_service()
        nxt: dict[str, Request] = {}
        while heads or nxt:
            for tenant in [t for t in heads if t not in nxt]:
                request = next(
                    (r for r in heads[tenant] if r.status is not RequestStatus.PREEMPTED), None
                )
                if request is None:
                    del heads[tenant]
                else:
                    nxt[tenant] = request
            if not nxt:
                break
            if not self._room():
                return _Verdict.STOP
            level = self.fair.level
            tenant = min(
                nxt, key=lambda t: (level(lane, t) + pending.get((lane, t), 0.0), nxt[t].rank)
            )
            verdict = self._try_admit(nxt.pop(tenant))
            if verdict is _Verdict.CAPPED:
                heads.pop(tenant, None)  # none of its requests may start this step
            elif verdict is not _Verdict.ADMITTED and verdict is not _Verdict.SKIP:
                return verdict
            elif self._lane_quota_spent(verdict):
                return _Verdict.NEXT_LANE
        return _Verdict.NEXT_LANE

    def _lane_quota_spent(self, verdict: _Verdict) -> bool:
        """Count an admission against `_admit_lane`'s limit; True once it is used up."""
        if verdict is not _Verdict.ADMITTED or self._lane_quota is None:
            return False
        self._lane_quota -= 1
        return self._lane_quota <= 0

    def admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs waiting requests whose whole known tokens
        fit in free blocks; they run (prefill, then decode) until the last one finishes.
        Siblings of a group are admitted like any request here (no fork).

        Without chunked prefill a `prompt_rows` request computes its whole prompt in one step,
        a row of logits per token beside one row for each other request of the batch: a batch
        of N whose longest such prompt is P needs N - 1 + P <= max_num_seqs, or that prompt
        would never be planned while the batch runs."""
        block_manager = self.block_manager
        max_num_seqs = self.config.max_num_seqs
        unchunked = not self.config.enable_chunked_prefill
        widest = 1  # rows the batch's widest one-step prefill takes
        for lane in self.waiting.lanes_in_order(self.step):
            for request in self.waiting.queue(lane):
                if len(self.running) >= max_num_seqs:
                    break
                if self._capped(request):
                    continue
                rows = request.num_tokens if unchunked and request.prompt_rows else 1
                if len(self.running) + max(widest, rows) > max_num_seqs:
                    continue  # it leads a later batch, which it fits alone
                hits = [] if request.prompt_rows else block_manager.lookup_prefix(request)
                needed = -(-request.num_tokens // self.block_size) - len(hits)
                free_after = (
                    block_manager.num_free_blocks - block_manager.num_reused_free(hits) - needed
                )
                if free_after < self.watermark_blocks:
                    return
                self._start_running(request, hits, fork=False)
                widest = max(widest, rows)

    # ---- helpers ---------------------------------------------------------------------------

    def _try_admit(self, request: Request) -> _Verdict:
        """Admit `request` with its first chunk: "admitted", "skip" (a sibling waiting for its
        group's prefill), "capped" (its tenant runs its max_running sequences), "next_lane"
        (long lane's share used up) or "stop"."""
        if request.request_id in self._promoted:  # admitted already, ahead of lane order
            return _Verdict.SKIP
        if self._capped(request):
            self.outcome.deferred = Deferral.TENANT_CAP
            return _Verdict.CAPPED
        block_manager = self.block_manager
        leader = self.group_leaders.get(request.group_id) if request.group_id else None
        fork = leader is not None and leader is not request and not request.output_token_ids
        if fork:
            if leader.num_computed_tokens < leader.num_prompt_tokens:
                return _Verdict.SKIP
            # Full prompt blocks only: the leader never writes them again, while the block
            # holding the prompt's tail also receives the leader's output tokens.
            hits = leader.block_ids[: (request.num_prompt_tokens - 1) // self.block_size]
        elif request.prompt_rows:
            hits = []  # every prompt position's row is wanted: compute them all
        else:
            hits = block_manager.lookup_prefix(request)
            if self._prefix_in_flight(request, len(hits)):
                self.outcome.deferred = Deferral.PREFIX_IN_FLIGHT
                return _Verdict.SKIP
        num_new = self._chunk_size(request, request.num_tokens - len(hits) * self.block_size)
        if num_new == 0:
            # With chunked prefill and budget left, only the long lane's share can say no.
            chunked = self.config.enable_chunked_prefill
            lane_share = chunked and self.budget > 0
            self.outcome.deferred = Deferral.LONG_LANE_SHARE if lane_share else "token_budget"
            return _Verdict.NEXT_LANE if lane_share else _Verdict.STOP
        needed = -(-(len(hits) * self.block_size + num_new) // self.block_size) - len(hits)
        free_after = block_manager.num_free_blocks - block_manager.num_reused_free(hits) - needed
        if free_after < self.watermark_blocks:
            self.outcome.deferred = Deferral.KV_WATERMARK
            return _Verdict.STOP
        self._start_running(request, hits, fork)
        block_manager.allocate(request, num_new)
        self._add_chunk(request, num_new)
        return _Verdict.ADMITTED

    def _prefix_in_flight(self, request: Request, num_hits: int) -> bool:
        """Whether the IN_FLIGHT_MIN_BLOCKS blocks after `request`'s cached prefix are being
        computed by running prefills (keys chain their prefix, so checking the last suffices)."""
        last = num_hits + IN_FLIGHT_MIN_BLOCKS - 1
        if last >= (request.num_tokens - 1) // self.block_size:  # as lookup_prefix's limit
            return False
        if self._in_flight is None:
            self._in_flight = {
                key
                for r in (*self.unfinished_prefills, *self.outcome.admitted)
                if r.request_id not in self.preempted
                for key in self._uncomputed_keys(r)
            }
        return self.block_manager.block_hash(request, last) in self._in_flight

    def _uncomputed_keys(self, request: Request) -> Iterator[bytes]:
        """Keys of `request`'s full blocks of known tokens that it has yet to compute."""
        for index in range(request.num_hashed_blocks, request.num_tokens // self.block_size):
            yield self.block_manager.block_hash(request, index)

    def _start_running(self, request: Request, hits: list[int], fork: bool) -> None:
        if fork:
            self.block_manager.fork(request, hits)
        elif self.block_manager.prefix_cache is not None:
            self.block_manager.use_prefix(request, hits)
        if self._in_flight is not None:  # its prefill joins those in flight
            self._in_flight.update(self._uncomputed_keys(request))
        self.outcome.admitted.append(request)
        insort(self.running, request, key=_rank)
        if self._extra_running is not None:
            self._extra_running[request.tenant] = self._extra_running.get(request.tenant, 0) + 1

    def _capped(self, request: Request) -> bool:
        """Whether `request`'s tenant already runs its max_running sequences."""
        if not self.fair.policy.max_running:
            return False
        if self._extra_running is None:
            extra: dict[str, int] = {}
            for admitted in self.outcome.admitted:
                extra[admitted.tenant] = extra.get(admitted.tenant, 0) + 1
            for victim in self.outcome.preempted:
                extra[victim.tenant] = extra.get(victim.tenant, 0) - 1
            self._extra_running = extra
        return self.fair.at_cap(request.tenant, self._extra_running.get(request.tenant, 0))

    def _chunk_size(self, request: Request, remaining: int) -> int:
        """Tokens of `remaining` that `request` may compute this step (0: none)."""
        config = self.config
        limit = self.budget
        if config.long_prefill_token_threshold:
            limit = min(limit, config.long_prefill_token_threshold)
        if request.prompt_rows:
            limit = min(limit, self._rows_left(request))
        if not config.enable_chunked_prefill:
            return remaining if remaining <= limit else 0
        if request.lane is Lane.LONG:
            limit = min(limit, self._long_lane_cap() - self.long_used)
        return min(remaining, limit)

    def _rows_left(self, request: Request) -> int:
        """Rows of logits a `prompt_rows` request's chunk may take: what running requests
        (one each, `request` counted) and other chunks' extra rows leave of max_num_seqs."""
        running = self.running
        index = bisect_left(running, request.rank, key=_rank)
        own = index < len(running) and running[index] is request  # its row is counted
        return max(0, self.config.max_num_seqs - len(running) - self.extra_rows + own)

    def _long_lane_cap(self) -> int:
        """Long-lane prefill tokens allowed this step: a share of the budget while other work
        shares the step, the whole budget when long prompts are all there is."""
        if self._long_cap is None:
            alone = (
                not self.decodes
                and all(request.lane is Lane.LONG for request in self.running)
                and not self.waiting.queue(Lane.INTERACTIVE)
                and not self.waiting.queue(Lane.BATCH)
            )
            budget = self.step_budget
            share = int(self.config.long_lane_max_share * budget)
            self._long_cap = budget if alone else max(1, share)
        return self._long_cap

    def _add_chunk(self, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        every_row = request.prompt_rows
        self.prefills.append(
            ScheduledSeq(
                request.request_id,
                start,
                request.all_token_ids[start:end],
                request.block_ids,
                end == request.num_tokens,
                request.prompt_token_ids,
                request.output_token_ids,
                every_row=every_row,
            )
        )
        if every_row:
            self.extra_rows += num_new - 1
        self.budget -= num_new
        if request.lane is Lane.LONG:
            self.long_used += num_new
        if self._pending is not None:
            self._note_service(self._pending, request, start, end, end == request.num_tokens, 1)

    def _note_service(
        self,
        pending: dict[tuple[str, str], float],
        request: Request,
        start: int,
        end: int,
        sample: bool,
        sign: int,
    ) -> None:
        prompt, output = service_of(request, start, end, sample)
        key = (request.lane, request.tenant)
        cost = self.fair.cost(request.tenant, prompt, output)
        pending[key] = pending.get(key, 0.0) + sign * cost

    def _pending_service(self) -> dict[tuple[str, str], float]:
        """Counter units scheduled so far this step, per (lane, tenant); kept up to date by
        `_add_chunk` and `_preempt` from the first call on."""
        if self._pending is None:
            self._pending = {}
            by_id = {request.request_id: request for request in self.running}
            for seq in self.decodes + self.prefills:
                request = by_id[seq.request_id]
                end = seq.start_pos + len(seq.token_ids)
                self._note_service(self._pending, request, seq.start_pos, end, seq.sample, 1)
        return self._pending

    def _grow_or_preempt(self, request: Request, num_new: int) -> bool:
        """Get blocks for `num_new` more tokens of running `request`, preempting victims
        (`_victim`) as needed; False if `request` itself was preempted."""
        while not self.block_manager.allocate(request, num_new):
            victim = self._victim()
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _victim(self) -> Request:
        """The running request to preempt: of the lowest running lane, the latest one (fcfs)
        or the latest of the tenant with the most service in that lane (vtc)."""
        running = self.running
        last = running[-1]
        if not self.vtc:
            return last
        lane = last.lane
        first = bisect_left(running, (LANE_RANK[lane],), key=_rank)
        candidates = running[first:]
        if len({r.tenant for r in candidates}) == 1:
            return last
        pending = self._pending_service()
        level = self.fair.level

        def served(r: Request) -> float:
            return level(lane, r.tenant) + pending.get((lane, r.tenant), 0.0)

        most = max(served(r) for r in candidates)
        return next(r for r in reversed(candidates) if served(r) == most)

    def _preempt(self, victim: Request) -> None:
        """Take the victim out of running and of this step's plan, and free its blocks now
        (the allocation that needs them follows)."""
        del self.running[bisect_left(self.running, victim.rank, key=_rank)]
        decoding = len(victim.all_token_ids) + victim.num_pending - victim.num_computed_tokens == 1
        seqs = self.decodes if decoding else self.prefills
        # fcfs: the victim ranks last, so if it was scheduled its seq is the last one of its
        # kind (both passes append in rank order); vtc victims may sit anywhere.
        candidates = range(len(seqs) - 1, -1 if self.vtc else max(-1, len(seqs) - 2), -1)
        index = next((i for i in candidates if seqs[i].request_id == victim.request_id), None)
        if index is not None:
            seq = seqs.pop(index)
            self.budget += len(seq.token_ids)
            self.extra_rows -= seq.num_rows - 1 - seq.num_drafts
            if victim.lane is Lane.LONG and not decoding:
                self.long_used -= len(seq.token_ids)
            if self._pending is not None:
                end = seq.start_pos + len(seq.token_ids)
                self._note_service(self._pending, victim, seq.start_pos, end, seq.sample, -1)
        self.block_manager.free(victim)
        self.preempted.add(victim.request_id)
        self.outcome.preempted.append(victim)
        if self._extra_running is not None:
            self._extra_running[victim.tenant] = self._extra_running.get(victim.tenant, 0) - 1
