"""Per-request scheduling state: tokens, progress, lane, KV block table, status."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Sequence

from jserve.config.scheduler import Lane
from jserve.core.stopping import StopConditions
from jserve.core.tenants import DEFAULT_TENANT
from jserve.outputs import FinishReason

LANE_RANK = {lane: rank for rank, lane in enumerate(Lane)}


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again, at the front of its lane, to recompute
    FINISHED = "finished"


class Request:
    """One sequence the scheduler drives.

    `all_token_ids` is prompt + output; tokens before `num_computed_tokens` have their KV in
    `block_ids` once the steps planned so far ran (the scheduler counts a step's tokens as
    computed when it plans it). Token storage is `array("q")` (int64), not lists: arrays hold
    no object references, so the garbage collector never walks them (lists of tokens made each
    full collection's cost grow with every live request's length; `python -m
    bench.scheduler_cost` shows the p99 it costs). The last known token is computed in the step
    that samples the next one, so a decoding request has exactly one uncomputed token:
    its last known one, or its pending one (`num_pending`) while the step sampling it runs.

    `stop` holds its stop rules (`max_tokens` among them; see jserve.core.stopping). A request the
    scheduler rejected is FINISHED with no finish reason. `deadline` is absolute, on the
    `time.monotonic()` clock (what it means: `jserve.core.deadlines`). `lane` may be given by
    name; the scheduler makes it a `Lane` when it queues the request, or refuses an unknown
    one. `tenant` names who it is served for (fair share and caps: `jserve.core.fairness`).
    With `can_speculate` (and speculation configured) its decodes carry draft tokens
    (jserve.core.planner). Siblings of an `n > 1` request share a `group_id` and the same
    prompt. With `prompt_rows` (prompt logprobs, mean pooling) each step computes a row of
    logits and hidden state at every prompt position it computes, so its chunks are bounded by
    the step's free rows (max_num_seqs in all) and its admission takes no cached prefix (whose
    rows nobody computes); the scheduler clears it once the prompt is computed. `cache_salt`
    (vLLM's) keys its prefix-cache blocks apart from those of requests with another salt or
    none (jserve.core.prefix_cache). Request ids must be unique among unfinished requests: the
    engine checks that once, for its users' ids, and derives these ids from them
    (jserve.engine.llm_engine.child_ids).
    """

    __slots__ = (
        "all_token_ids",
        "arrival_time",
        "block_hashes",
        "block_ids",
        "cache_salt",
        "can_speculate",
        "deadline",
        "draft_acceptance",
        "draft_kind",
        "enqueued_step",
        "finish_reason",
        "group_id",
        "lane",
        "num_cached_tokens",
        "num_computed_tokens",
        "num_hashed_blocks",
        "num_pending",
        "num_preemptions",
        "num_prompt_served",
        "num_prompt_tokens",
        "output_token_ids",
        "prompt_rows",
        "prompt_token_ids",
        "rank",
        "request_id",
        "status",
        "stop",
        "tenant",
    )

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        *,
        stop: StopConditions | None = None,
        arrival_time: float | None = None,
        lane: Lane | str = Lane.INTERACTIVE,
        deadline: float | None = None,
        group_id: str | None = None,
        tenant: str = DEFAULT_TENANT,
        can_speculate: bool = False,
        prompt_rows: bool = False,
        cache_salt: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.cache_salt = cache_salt
        self.prompt_rows = prompt_rows
        # Whether drafts may be verified for it (the engine's call: unconstrained).
        self.can_speculate = can_speculate
        # Its drafts' recent acceptance, each given the ones before it
        # (jserve.core.ngram.note_acceptance), one average per kind of draft (guess, copy),
        # and the kind of the drafts in flight.
        self.draft_acceptance = [1.0, 1.0]
        self.draft_kind = 0
        self.prompt_token_ids = tuple(prompt_token_ids)
        self.all_token_ids = array("q", self.prompt_token_ids)
        self.output_token_ids = array("q")
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.stop = StopConditions() if stop is None else stop
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.lane = lane
        self.deadline = deadline
        self.group_id = group_id
        self.tenant = tenant

        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.num_computed_tokens = 0
        # Tokens a planned step samples that are not known yet (0 or 1): with async
        # scheduling the next step is planned before they arrive (jserve.core.scheduler).
        self.num_pending = 0
        self.num_cached_tokens = 0  # prefix-cache (or fork) hit at first admission
        self.num_preemptions = 0
        # Prompt positions already charged to the tenant's fair-share counter: recomputing
        # them after a preemption is the scheduler's cost, not the tenant's (core.fairness).
        self.num_prompt_served = 0
        self.block_ids: list[int] = []
        # Chained hashes of full blocks of known tokens; block i is in the prefix cache once
        # i < num_hashed_blocks (set by the block manager, which owns the cache).
        self.block_hashes: list[bytes] = []
        self.num_hashed_blocks = 0
        # Set by the scheduler: (lane rank, arrival, admission order) - smaller runs first.
        self.rank: tuple[int, float, int] = (0, 0.0, 0)
        self.enqueued_step = 0  # iteration at which it last entered the waiting queue

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, lane={self.lane}, status={self.status.value}, "
            f"computed={self.num_computed_tokens}/{self.num_tokens}, "
            f"blocks={len(self.block_ids)})"
        )
