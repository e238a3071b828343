"""Admission checks for a new request; each failure names the reason a server maps to a status.

Besides the request's own validity and the queue cap, two checks refuse work the engine can
see it will fail: KV usage above `kv_reject_watermark` ("kv_full"), and a deadline that the
estimated finish time misses ("deadline"). The estimate (`estimate_finish`) prices steps with
the measured per-bucket costs (jserve.core.step_costs) and is deliberately pessimistic: it
assumes the request and everyone ahead of it generate their full `max_tokens`, and it counts
the prompt without prefix-cache hits, so an admitted request should not time out for lack of
capacity (set `max_tokens` on requests that carry a deadline). Without any measured cost yet,
deadlines are not checked at arrival (they still expire).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from jserve.config.scheduler import LANES, SchedulerConfig
from jserve.core.queues import WaitingQueues
from jserve.core.request import LANE_RANK, Request
from jserve.core.step_costs import StepCosts
from jserve.errors import RejectReason, RequestRejected


def check_new_request(
    request: Request,
    config: SchedulerConfig,
    num_waiting: int,
) -> None:
    """Raise RequestRejected unless `request` may join the waiting queue (its id is the
    caller's to keep unique: see Request).

    `num_waiting` counts sequences: each sample of an `n > 1` request is one, so a request
    with many samples meets the cap like as many requests (it cannot slip past it).
    """
    if request.num_prompt_tokens == 0:
        raise RequestRejected(
            RejectReason.INVALID, "the prompt has no tokens; send at least one token",
            param="prompt",
        )  # fmt: skip
    max_tokens, min_tokens = request.stop.max_tokens, request.stop.min_tokens
    if max_tokens < 1 or min_tokens < 0:
        raise RequestRejected(
            RejectReason.INVALID,
            f"max_tokens must be >= 1 and min_tokens >= 0, got max_tokens={max_tokens}, "
            f"min_tokens={min_tokens}",
            param="max_tokens" if max_tokens < 1 else "min_tokens",
        )
    if request.lane not in LANES:
        names = tuple(str(lane) for lane in LANES)
        raise RequestRejected(
            RejectReason.INVALID, f"lane must be one of {names}, got {request.lane!r}",
            param="lane",
        )  # fmt: skip
    check_fits(request.num_prompt_tokens, max_tokens, config.max_model_len)
    if num_waiting >= config.max_waiting_requests:
        raise RequestRejected(
            RejectReason.QUEUE_FULL,
            f"{num_waiting} sequences are already waiting (max_waiting_requests="
            f"{config.max_waiting_requests}, each of a request's n samples counts); retry later",
        )


@dataclass(frozen=True)
class FinishEstimate:
    wait: float  # seconds of the work ahead of the request in its lane and those above
    total: float  # seconds until it would finish: the wait plus its own prefill and decode


def estimate_finish(
    request: Request,
    config: SchedulerConfig,
    costs: StepCosts,
    running: Sequence[Request],
    waiting: WaitingQueues,
    budget: int,
) -> FinishEstimate | None:
    """How long `request` would take if admitted now; None if no step cost is known.

    Its wait is the longer of two: the prefill work ahead of it (the running prompts' rest,
    then the prompts waiting ahead in its lane and those above), in full steps of `budget`
    tokens; and the steps until a sequence slot frees for it (`_slot_turnover`: each running
    request holds its slot for its remaining decodes, each request ahead, in queue order,
    takes the earliest freed slot for its `max_tokens`). Steps of that wait beyond the
    prefill are priced as decode steps. Then its own prompt in full steps, and its
    `max_tokens` decode steps: steps of the running batch, or the recent average step if
    longer (later arrivals' chunks share them), except that prompts sharing them make full
    steps of as many as their chunks fill. Those prompts are lower lanes' requests in the
    slots left free and, while work waits ahead of it (an overload: more will arrive behind
    it), one as long as theirs in every slot that frees during its decode. Aging lets each
    lower lane with work waiting put one request ahead every `aging_iterations` steps: those
    count as ahead too, with the lower lanes' heads' mean prompt and longest `max_tokens`.
    """
    rank = LANE_RANK[request.lane]
    ahead = [r for lane in LANES[: rank + 1] for r in waiting.queue(lane)]
    lower = [waiting.queue(lane) for lane in LANES[rank + 1 :] if waiting.queue(lane)]
    num_seqs = config.max_num_seqs
    batch = min(num_seqs, len(running) + len(ahead) + 1)
    full_step = costs.cost(budget, batch)
    decode_step = costs.cost(batch, batch)
    if full_step is None or decode_step is None:
        return None
    # Prompts that will share its decode steps: lower lanes' requests in the slots left free
    # once it and those ahead run, and, while work waits ahead of it (an overload: more will
    # arrive behind it), a prompt as long as theirs in every slot that frees during them.
    free = num_seqs - (len(running) + len(ahead) + 1)
    queue = _Queue(
        num_seqs, budget, batch, full_step,
        decode_step=max(decode_step, costs.recent or 0.0),  # later arrivals' chunks share steps
        prefill_ahead=sum(r.num_tokens for r in ahead)
        + sum(max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running),
        held=[r.stop.max_tokens - r.num_output_tokens for r in running],
        fill=sum(r.num_tokens for r in itertools.islice(itertools.chain(*lower), max(0, free))),
        mean_prompt_ahead=sum(r.num_tokens for r in ahead) / len(ahead) if ahead else 0.0,
    )  # fmt: skip
    queued = [r.stop.max_tokens for r in ahead]
    result = queue.finish(request, queued, 0.0)
    if lower:
        steps = result.total / min(full_step, queue.decode_step)
        promoted = len(lower) * -(-int(steps) // config.aging_iterations)
        heads = [q[0] for q in lower]
        prompt = sum(r.num_tokens for r in heads) / len(heads)
        decodes = max(r.stop.max_tokens - r.num_output_tokens for r in heads)
        result = queue.finish(request, [decodes] * promoted + queued, promoted * prompt)
    return result


@dataclass(frozen=True)
class _Queue:
    """What a new request would queue behind, priced in steps (see estimate_finish)."""

    num_seqs: int
    budget: int  # tokens a step takes
    batch: int  # sequences a step runs
    full_step: float  # seconds of a step of `budget` tokens
    decode_step: float  # seconds of a step of decodes only
    prefill_ahead: int  # prompt tokens to compute before its own
    held: list[int]  # the running requests' remaining decodes
    fill: int  # prompt tokens of lower lanes' requests in the slots left free
    mean_prompt_ahead: float  # of the requests ahead of it (0 when none)

    def finish(self, request: Request, queued: list[int], prefill_queued: float) -> FinishEstimate:
        """The estimate with `queued` (each one's decodes) and `prefill_queued` more prompt
        tokens ahead of `request`."""
        budget, full_step, decode_step = self.budget, self.full_step, self.decode_step
        max_tokens = request.stop.max_tokens
        prefill_steps = (self.prefill_ahead + prefill_queued) / budget
        start, frees = _slot_turnover(self.num_seqs, self.held, queued)
        wait = prefill_steps * full_step + max(0.0, start - prefill_steps) * decode_step
        refills = (
            sum(start < t < start + max_tokens for t in frees) if self.mean_prompt_ahead else 0
        )
        shared = self.fill + refills * self.mean_prompt_ahead
        full_decodes = min(max_tokens, math.ceil(shared / max(1, budget - self.batch)))
        own = (
            request.num_prompt_tokens / budget * full_step
            + full_decodes * full_step
            + (max_tokens - full_decodes) * decode_step
        )
        return FinishEstimate(wait, wait + own)


def _slot_turnover(
    num_seqs: int, held: Sequence[int], queued: Sequence[int]
) -> tuple[int, list[int]]:
    """When a new request gets one of `num_seqs` sequence slots, and the steps at which the
    other slots free after that: running requests hold theirs for `held` more steps each, and
    the `queued` ahead of it, in order, each take the earliest slot that frees and hold it
    that many steps (one token a step)."""
    frees = sorted(held)[:num_seqs]
    frees += [0] * (num_seqs - len(frees))
    heapq.heapify(frees)
    for steps in queued:
        heapq.heappush(frees, heapq.heappop(frees) + steps)
    start = heapq.heappop(frees)
    return start, frees


def check_deadline(request: Request, estimate: FinishEstimate | None, now: float) -> None:
    """Refuse ("deadline") a request whose deadline is earlier than its estimated finish."""
    if request.deadline is None or estimate is None or now + estimate.total <= request.deadline:
        return
    raise RequestRejected(
        RejectReason.DEADLINE,
        f"the deadline cannot be met: finishing is estimated to take {estimate.total:.2f} s "
        f"({estimate.wait:.2f} s of queued work ahead in lane '{request.lane}', then "
        f"{request.num_prompt_tokens} prompt tokens and up to {request.stop.max_tokens} output "
        f"tokens), but the timeout leaves {max(0.0, request.deadline - now):.2f} s; retry "
        f"later, raise the timeout or lower max_tokens",
        retry_after=max(1.0, math.ceil(estimate.wait)),
    )


def check_kv_usage(usage: float, config: SchedulerConfig) -> None:
    """Refuse ("kv_full") new work while KV usage is above the reject watermark."""
    if usage > config.kv_reject_watermark:
        raise RequestRejected(
            RejectReason.KV_FULL,
            f"KV cache usage is {usage:.1%}, above the reject watermark "
            f"{config.kv_reject_watermark:.1%} (kv_reject_watermark); retry later",
            retry_after=1.0,
        )


def check_fits(num_prompt_tokens: int, max_tokens: int, max_model_len: int) -> None:
    """Raise RequestRejected (too long) unless the prompt and max_tokens fit max_model_len."""
    total = num_prompt_tokens + max_tokens
    if total > max_model_len:
        raise RequestRejected(
            RejectReason.TOO_LONG,
            f"the prompt has {num_prompt_tokens} tokens and max_tokens is {max_tokens}: "
            f"{total} tokens exceed max_model_len={max_model_len}; shorten the prompt or "
            f"lower max_tokens",
        )
