"""Iteration-level scheduler: which tokens of which requests the next step computes.

One iteration, as the engine drives it:
1. `schedule()` may change everything here: it expires waiting requests past their deadline,
   then builds a `StepPlan` in three passes over a token budget:
   a. running decodes, one token each, in priority order (lane, then arrival);
   b. running prefills (chunked prompts, recomputes after preemption), in priority order;
   c. waiting requests, lane by lane (aged lanes first), FIFO inside a lane, each admitted
      with its cached prefix and a first chunk while sequences, budget and free blocks above
      the watermark allow. With the "static" policy, (c) is replaced by admitting a whole batch
      only when nothing runs.
   When a running request cannot get a block, the lowest-priority running request (latest
   arrival of the lowest lane) is preempted: its blocks are freed and it goes back to the front
   of its lane with every token kept, to recompute them (cheaply, with prefix caching).
2. The runtime computes the plan; the scheduler must not be called meanwhile, except
   `abort`/`finish_request`, whose requests the next `update_from_output` skips.
3. `update_from_output()` advances progress, appends sampled tokens, caches newly filled blocks
   and finishes requests on a stop token or max_tokens, returning those it finished.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort
from collections.abc import Mapping
from dataclasses import dataclass
from operator import attrgetter

from jserve.config import CacheConfig, SchedulerConfig
from jserve.core.admission import check_new_request
from jserve.core.block_manager import BlockManager
from jserve.core.plan import ScheduledSeq, StepPlan
from jserve.core.queues import WaitingQueues
from jserve.core.request import LANE_RANK, FinishReason, Request, RequestStatus

_priority = attrgetter("priority")


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
    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, scheduler_config.enable_prefix_caching
        )
        usable = self.block_manager.num_usable_blocks
        self.watermark_blocks = int(scheduler_config.free_block_watermark * usable)
        blocks_per_seq = -(-scheduler_config.max_model_len // cache_config.block_size)
        if blocks_per_seq + self.watermark_blocks > usable:
            raise ValueError(
                f"num_blocks={cache_config.num_blocks} leaves {usable} usable blocks, but one "
                f"request of max_model_len={scheduler_config.max_model_len} needs "
                f"{blocks_per_seq} blocks of {cache_config.block_size} tokens plus "
                f"{self.watermark_blocks} watermark blocks; raise num_blocks or lower "
                f"max_model_len"
            )
        self.running: list[Request] = []  # sorted by Request.priority, highest first
        self.waiting = WaitingQueues(scheduler_config.aging_iterations)
        self.num_preemptions = 0
        self._requests: dict[str, Request] = {}  # every unfinished request
        self._group_leaders: dict[str, Request] = {}  # group_id -> the member that prefills
        self._finished_since_plan: dict[str, FinishReason] = {}
        self._num_added = 0
        self._step = 0
        # Per-step state, reset by schedule().
        self._budget = 0
        self._long_used = 0
        self._long_cap: int | None = None
        self._plan = StepPlan()
        self._decodes: list[ScheduledSeq] = []
        self._prefills: list[ScheduledSeq] = []

    # ---- admission and removal -------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue `request`, or raise RequestRejected ("invalid", "too_long", "queue_full").

        Siblings of an `n > 1` group (same `group_id`, added after the first member) skip the
        queue cap: the group was admitted with its first member.
        """
        is_sibling = request.group_id is not None and request.group_id in self._group_leaders
        try:
            check_new_request(request, self.config, self._requests, len(self.waiting), is_sibling)
        except Exception:
            request.status = RequestStatus.FINISHED
            request.finish_reason = FinishReason.REJECTED
            raise
        if request.lane == "interactive" and (
            request.num_prompt_tokens > self.config.long_prompt_threshold
        ):
            request.lane = "long"
        self._num_added += 1
        request.priority = (LANE_RANK[request.lane], request.arrival_time, self._num_added)
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        if request.group_id is not None and not is_sibling:
            self._group_leaders[request.group_id] = request
        self.waiting.push_back(request, self._step)

    def abort(self, request_id: str) -> bool:
        """End a request in any state and free its blocks now; False if it is unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._remove_and_finish(request, FinishReason.ABORTED)
        self._finished_since_plan[request_id] = FinishReason.ABORTED
        return True

    def finish_request(self, request_id: str, reason: FinishReason) -> bool:
        """End a request the engine found finished (e.g. a stop string); False if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        self._remove_and_finish(request, reason)
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

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
        """Plan the next step (`now` on the time.monotonic() clock, for deadlines)."""
        self._step += 1
        plan = self._plan = StepPlan(finished=self._finished_since_plan)
        self._finished_since_plan = {}
        for request in self.waiting.pop_expired(time.monotonic() if now is None else now):
            self._finish(request, FinishReason.DEADLINE)
            plan.finished[request.request_id] = FinishReason.DEADLINE
        self._budget = self.config.max_num_batched_tokens
        self._long_used = 0
        self._long_cap = None
        self._decodes = []
        self._prefills = []

        if self.config.policy == "static" and not self.running:
            self._admit_static_batch()
        self._schedule_running_decodes()
        self._schedule_running_prefills()
        if self.config.policy == "continuous":
            self._admit_waiting()

        plan.seqs = self._decodes + self._prefills
        plan.num_decodes = len(self._decodes)
        plan.num_batched_tokens = self.config.max_num_batched_tokens - self._budget
        return plan

    def update_from_output(self, plan: StepPlan, sampled: Mapping[str, int]) -> list[Request]:
        """Record that `plan` ran; `sampled` maps request id -> new token for seqs with
        `sample`. Returns the requests this finished (stop token or max_tokens)."""
        requests = self._requests
        block_manager = self.block_manager
        caching = block_manager.prefix_cache is not None
        running = RequestStatus.RUNNING
        finished = []
        for seq in plan.seqs:
            request = requests.get(seq.request_id)
            if request is None or request.status is not running:
                continue  # aborted or finished by the engine while the step ran
            request.num_computed_tokens = seq.start_pos + len(seq.token_ids)
            if caching:
                block_manager.cache_full_blocks(request)
            if not seq.sample:
                continue
            try:
                token_id = sampled[seq.request_id]
            except KeyError:
                raise ValueError(
                    f"no sampled token for request {seq.request_id!r}, whose chunk had "
                    f"sample=True; pass one token for every such seq of the plan"
                ) from None
            request.append_output_token(token_id)
            num_output = len(request.output_token_ids)
            if token_id in request.stop_token_ids and num_output >= request.min_tokens:
                self._finish(request, FinishReason.STOPPED)
                finished.append(request)
            elif num_output >= request.max_tokens:
                self._finish(request, FinishReason.LENGTH)
                finished.append(request)
        if finished:
            self.running = [r for r in self.running if r.status is running]
        return finished

    # ---- the three passes ------------------------------------------------------------------

    def _schedule_running_decodes(self) -> None:
        running = self.running
        block_size = self.block_size
        step = self._step
        decodes = self._decodes
        index = 0
        while index < len(running):
            request = running[index]
            start = request.num_computed_tokens
            if len(request.all_token_ids) - start != 1:
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
                )
            )
            request.scheduled_step = step
            index += 1
        self._budget -= len(decodes)

    def _schedule_running_prefills(self) -> None:
        running = self.running
        index = 0
        while index < len(running) and self._budget > 0:
            request = running[index]
            if request.scheduled_step == self._step:
                index += 1
                continue
            remaining = request.num_tokens - request.num_computed_tokens
            num_new = self._chunk_size(request, remaining)
            if num_new and self.config.enable_chunked_prefill:
                # Take what free blocks hold rather than preempting someone for the rest.
                fits = (
                    len(request.block_ids) + self.block_manager.num_free_blocks
                ) * self.block_size - request.num_computed_tokens
                num_new = min(num_new, max(fits, 1))
            if num_new == 0:
                index += 1
                continue
            if not self._grow_or_preempt(request, num_new):
                continue  # preempted itself: it was the lowest-priority one left
            self._add_chunk(request, num_new)
            index += 1

    def _admit_waiting(self) -> None:
        max_num_seqs = self.config.max_num_seqs
        for lane in self.waiting.lanes_in_order(self._step):
            queue = self.waiting.queue(lane)
            index = 0
            while index < len(queue):
                if len(self.running) >= max_num_seqs or self._budget == 0:
                    return
                verdict = self._try_admit(queue[index])
                if verdict == "admitted":
                    del queue[index]
                    self.waiting.note_removed()
                elif verdict == "skip":
                    index += 1
                elif verdict == "next_lane":
                    break
                else:
                    return

    def _admit_static_batch(self) -> None:
        """Static batching: take up to max_num_seqs waiting requests whose whole known tokens
        fit in free blocks; they run (prefill, then decode) until the last one finishes."""
        block_manager = self.block_manager
        for lane in self.waiting.lanes_in_order(self._step):
            queue = self.waiting.queue(lane)
            while queue and len(self.running) < self.config.max_num_seqs:
                request = queue[0]
                hits = block_manager.lookup_prefix(request)
                needed = -(-request.num_tokens // self.block_size) - len(hits)
                free_after = (
                    block_manager.num_free_blocks - block_manager.num_reused_free(hits) - needed
                )
                if free_after < self.watermark_blocks:
                    return
                queue.popleft()
                self.waiting.note_removed()
                self._start_running(request, hits, fork=False)

    # ---- helpers ---------------------------------------------------------------------------

    def _try_admit(self, request: Request) -> str:
        """Admit `request` with its first chunk: "admitted", "skip" (a sibling waiting for its
        group's prefill), "next_lane" (long lane's share used up) or "stop"."""
        block_manager = self.block_manager
        leader = self._group_leaders.get(request.group_id) if request.group_id else None
        fork = leader is not None and leader is not request and not request.output_token_ids
        if fork:
            if leader.num_computed_tokens < leader.num_prompt_tokens:
                return "skip"
            # Full prompt blocks only: the leader never writes them again, while the block
            # holding the prompt's tail also receives the leader's output tokens.
            hits = leader.block_ids[: (request.num_prompt_tokens - 1) // self.block_size]
        else:
            hits = block_manager.lookup_prefix(request)
        remaining = request.num_tokens - len(hits) * self.block_size
        num_new = self._chunk_size(request, remaining)
        if num_new == 0:
            # With chunked prefill and budget left, only the long lane's share can say no.
            chunked = self.config.enable_chunked_prefill
            return "next_lane" if chunked and self._budget > 0 else "stop"
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
        if request.num_preemptions == 0:
            request.num_cached_tokens = request.num_computed_tokens
        request.status = RequestStatus.RUNNING
        insort(self.running, request, key=_priority)

    def _chunk_size(self, request: Request, remaining: int) -> int:
        """Tokens of `remaining` that `request` may compute this step (0: none)."""
        config = self.config
        limit = self._budget
        if config.long_prefill_token_threshold:
            limit = min(limit, config.long_prefill_token_threshold)
        if not config.enable_chunked_prefill:
            return remaining if remaining <= limit else 0
        if request.lane == "long":
            limit = min(limit, self._long_lane_cap() - self._long_used)
        return min(remaining, limit)

    def _long_lane_cap(self) -> int:
        """Long-lane prefill tokens allowed this step: a share of the budget while other work
        shares the step, the whole budget when long prompts are all there is."""
        if self._long_cap is None:
            alone = (
                not self._decodes
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
        self._prefills.append(
            ScheduledSeq(
                request.request_id,
                start,
                request.all_token_ids[start:end],
                request.block_ids,
                end == request.num_tokens,
            )
        )
        request.scheduled_step = self._step
        self._budget -= num_new
        if request.lane == "long":
            self._long_used += num_new

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
        self.running.pop()  # the victim is always the last, lowest-priority running request
        if victim.scheduled_step == self._step:
            # Only a decode can be scheduled yet rank below the request that needs its blocks
            # (prefills are visited in priority order); decodes were appended in that order.
            seq = self._decodes.pop()
            assert seq.request_id == victim.request_id
            self._budget += 1
            victim.scheduled_step = -1
        self.block_manager.free(victim)
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        victim.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.push_front(victim, self._step)
        self._plan.preempted_ids.append(victim.request_id)

    def _remove_and_finish(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            index = bisect_left(self.running, request.priority, key=_priority)
            del self.running[index]
        else:
            self.waiting.remove(request)
        self._finish(request, reason)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Free and forget `request` (the caller already took it out of running/waiting)."""
        self.block_manager.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        del self._requests[request.request_id]
        if request.group_id is not None and self._group_leaders.get(request.group_id) is request:
            del self._group_leaders[request.group_id]
