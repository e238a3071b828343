"""The three passes that turn the scheduler's queues into one StepPlan, as one function.

Over one step's token budget:
a. running decodes, one token each, in rank order (lane, then arrival);
b. running prefills (chunked prompts, recomputes after preemption), in rank order;
c. unless (a) or (b) preempted, waiting requests, lane by lane (aged lanes first), FIFO inside
   a lane, each admitted with its cached prefix and a first chunk while sequences, budget and
   free blocks above the watermark allow. With scheduling="static", (c) is replaced by
   admitting a whole batch only when nothing runs.
When a running request cannot get a block, the lowest-ranked running request (latest arrival
of the lowest lane) is preempted: its blocks are freed and it goes back to the front of its
lane with every token kept, to recompute them (cheaply, with prefix caching).

`plan_step` reads the scheduler's running list and waiting queues and returns what it decided
(`PlanOutcome`): the plan, the new running list, and which requests it admitted and preempted.
It never changes the scheduler's containers; the scheduler applies the outcome, so the
invariants of running and waiting are kept in one place. What it does change, and why it must:
block tables through the block manager (a preempted request's blocks are what the next
allocation takes, so they are freed as the pass goes).
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from jserve.config import SchedulerConfig
from jserve.core.block_manager import BlockManager
from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.core.queues import WaitingQueues
from jserve.core.request import Request

_rank = attrgetter("rank")


@dataclass
class PlanOutcome:
    """What one `plan_step` decided; the scheduler applies it."""

    plan: StepPlan
    running: list[Request]  # the new running list, sorted by Request.rank
    admitted: list[Request] = field(default_factory=list)  # left waiting, in admission order
    # Lost their blocks, in preemption order; they go back to the front of their lane, tokens
    # kept (a request admitted by the static policy may be admitted and preempted in one step).
    preempted: list[Request] = field(default_factory=list)


def plan_step(
    config: SchedulerConfig,
    block_manager: BlockManager,
    running: Sequence[Request],
    waiting: WaitingQueues,
    group_leaders: Mapping[str, Request],
    watermark_blocks: int,
    step: int,
) -> PlanOutcome:
    """Plan iteration `step` with the passes above; `running` is sorted by rank."""
    return _Planner(
        config, block_manager, running, waiting, group_leaders, watermark_blocks, step
    ).build()


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
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.block_size = block_manager.block_size
        self.waiting = waiting
        self.group_leaders = group_leaders
        self.watermark_blocks = watermark_blocks
        self.step = step
        self.outcome = PlanOutcome(StepPlan(), list(running))
        self.running = self.outcome.running
        self.budget = config.max_num_batched_tokens
        self.long_used = 0
        self._long_cap: int | None = None
        self.decodes: list[ScheduledSeq] = []
        self.prefills: list[ScheduledSeq] = []
        self.unfinished_prefills: list[Request] = []  # running, short of their known tokens
        self.preempted: set[str] = set()

    def build(self) -> PlanOutcome:
        static = self.config.scheduling == "static"
        if static and not self.running:
            self.admit_static_batch()
        self.schedule_running_decodes()
        self.schedule_running_prefills()
        if not static and not self.preempted:
            # Blocks ran out this step: admitting now would only set up the next preemption.
            self.admit_waiting()
        plan = self.outcome.plan
        plan.seqs = self.decodes + self.prefills
        plan.num_decodes = len(self.decodes)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - self.budget
        plan.preempted_ids = [request.request_id for request in self.outcome.preempted]
        return self.outcome

    # ---- the passes ------------------------------------------------------------------------

    def schedule_running_decodes(self) -> None:
        """(a) One token for every running request that has exactly one uncomputed token;
        notes the others (prefilling) for pass (b)."""
        running = self.running
        block_size = self.block_size
        decodes = self.decodes
        unfinished_prefills = self.unfinished_prefills
        index = 0
        while index < len(running):
            request = running[index]
            start = request.num_computed_tokens
            if len(request.all_token_ids) - start != 1:
                unfinished_prefills.append(request)
                index += 1
                continue
            if start >= len(request.block_ids) * block_size and not self._grow_or_preempt(
                request, 1
            ):
                continue  # `request` preempted itself; it was the last one
            decodes.append(
                ScheduledSeq(
                    request.request_id,
                    start,
                    request.all_token_ids[start:],
                    request.block_ids,
                    True,
                    request.prompt_token_ids,
                    request.output_token_ids,
                )
            )
            index += 1
        self.budget -= len(decodes)

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

    def admit_waiting(self) -> None:
        """(c) Waiting requests by lane order, FIFO inside a lane, while room is left."""
        max_num_seqs = self.config.max_num_seqs
        for lane in self.waiting.lanes_in_order(self.step):
            for request in self.waiting.queue(lane):
                if len(self.running) >= max_num_seqs or self.budget == 0:
                    return
                verdict = self._try_admit(request)
                if verdict == "next_lane":
                    break
                if verdict == "stop":
                    return

    def admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs waiting requests whose whole known tokens
        fit in free blocks; they run (prefill, then decode) until the last one finishes.
        Siblings of a group are admitted like any request here (no fork)."""
        block_manager = self.block_manager
        for lane in self.waiting.lanes_in_order(self.step):
            for request in self.waiting.queue(lane):
                if len(self.running) >= self.config.max_num_seqs:
                    break
                hits = block_manager.lookup_prefix(request)
                needed = -(-request.num_tokens // self.block_size) - len(hits)
                free_after = (
                    block_manager.num_free_blocks - block_manager.num_reused_free(hits) - needed
                )
                if free_after < self.watermark_blocks:
                    return
                self._start_running(request, hits, fork=False)

    # ---- helpers ---------------------------------------------------------------------------

    def _try_admit(self, request: Request) -> str:
        """Admit `request` with its first chunk: "admitted", "skip" (a sibling waiting for its
        group's prefill), "next_lane" (long lane's share used up) or "stop"."""
        block_manager = self.block_manager
        leader = self.group_leaders.get(request.group_id) if request.group_id else None
        fork = leader is not None and leader is not request and not request.output_token_ids
        if fork:
            if leader.num_computed_tokens < leader.num_prompt_tokens:
                return "skip"
            # Full prompt blocks only: the leader never writes them again, while the block
            # holding the prompt's tail also receives the leader's output tokens.
            hits = leader.block_ids[: (request.num_prompt_tokens - 1) // self.block_size]
        else:
            hits = block_manager.lookup_prefix(request)
        num_new = self._chunk_size(request, request.num_tokens - len(hits) * self.block_size)
        if num_new == 0:
            # With chunked prefill and budget left, only the long lane's share can say no.
            chunked = self.config.enable_chunked_prefill
            return "next_lane" if chunked and self.budget > 0 else "stop"
        needed = -(-(len(hits) * self.block_size + num_new) // self.block_size) - len(hits)
        free_after = block_manager.num_free_blocks - block_manager.num_reused_free(hits) - needed
        if free_after < self.watermark_blocks:
            return "stop"
        self._start_running(request, hits, fork)
        block_manager.allocate(request, num_new)
        self._add_chunk(request, num_new)
        return "admitted"

    def _start_running(self, request: Request, hits: list[int], fork: bool) -> None:
        if fork:
            self.block_manager.fork(request, hits)
        elif self.block_manager.prefix_cache is not None:
            self.block_manager.use_prefix(request, hits)
        self.outcome.admitted.append(request)
        insort(self.running, request, key=_rank)

    def _chunk_size(self, request: Request, remaining: int) -> int:
        """Tokens of `remaining` that `request` may compute this step (0: none)."""
        config = self.config
        limit = self.budget
        if config.long_prefill_token_threshold:
            limit = min(limit, config.long_prefill_token_threshold)
        if not config.enable_chunked_prefill:
            return remaining if remaining <= limit else 0
        if request.lane == "long":
            limit = min(limit, self._long_lane_cap() - self.long_used)
        return min(remaining, limit)

    def _long_lane_cap(self) -> int:
        """Long-lane prefill tokens allowed this step: a share of the budget while other work
        shares the step, the whole budget when long prompts are all there is."""
        if self._long_cap is None:
            alone = (
                not self.decodes
                and all(request.lane == "long" for request in self.running)
                and not self.waiting.queue("interactive")
                and not self.waiting.queue("batch")
            )
            budget = self.config.max_num_batched_tokens
            share = int(self.config.long_lane_max_share * budget)
            self._long_cap = budget if alone else max(1, share)
        return self._long_cap

    def _add_chunk(self, request: Request, num_new: int) -> None:
        start = request.num_computed_tokens
        end = start + num_new
        self.prefills.append(
            ScheduledSeq(
                request.request_id,
                start,
                request.all_token_ids[start:end],
                request.block_ids,
                end == request.num_tokens,
                request.prompt_token_ids,
                request.output_token_ids,
            )
        )
        self.budget -= num_new
        if request.lane == "long":
            self.long_used += num_new

    def _grow_or_preempt(self, request: Request, num_new: int) -> bool:
        """Get blocks for `num_new` more tokens of running `request`, preempting the
        lowest-priority running requests as needed; False if `request` itself was preempted."""
        while not self.block_manager.allocate(request, num_new):
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request) -> None:
        """Free the victim's blocks now (the allocation that needs them follows)."""
        self.running.pop()  # the victim is always the last, lowest-priority one
        decodes = self.decodes
        if decodes and decodes[-1].request_id == victim.request_id:
            # Only a decode can be scheduled yet rank below the request that needs its blocks
            # (prefills are visited in priority order), and decodes were appended in priority
            # order: a scheduled victim holds the last one.
            decodes.pop()
            self.budget += 1
        self.block_manager.free(victim)
        self.preempted.add(victim.request_id)
        self.outcome.preempted.append(victim)
