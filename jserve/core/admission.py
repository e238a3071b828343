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

import math
from collections.abc import Sequence
from dataclasses import dataclass

from jserve.config import LANES, SchedulerConfig
from jserve.core.queues import WaitingQueues
from jserve.core.request import LANE_RANK, Request
from jserve.core.step_costs import StepCosts
from jserve.errors import RequestRejected


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
        raise RequestRejected("invalid", "the prompt has no tokens; send at least one token")
    max_tokens, min_tokens = request.stop.max_tokens, request.stop.min_tokens
    if max_tokens < 1 or min_tokens < 0:
        raise RequestRejected(
            "invalid",
            f"max_tokens must be >= 1 and min_tokens >= 0, got max_tokens={max_tokens}, "
            f"min_tokens={min_tokens}",
        )
    if request.lane not in LANES:
        raise RequestRejected("invalid", f"lane must be one of {LANES}, got {request.lane!r}")
    total = request.num_prompt_tokens + max_tokens
    if total > config.max_model_len:
        raise RequestRejected(
            "too_long",
            f"the prompt has {request.num_prompt_tokens} tokens and max_tokens is "
            f"{max_tokens}: {total} tokens exceed max_model_len={config.max_model_len}; "
            f"shorten the prompt or lower max_tokens",
        )
    if num_waiting >= config.max_waiting_requests:
        raise RequestRejected(
            "queue_full",
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

    Prefill tokens (of those ahead, then its own) go through full steps of `budget` tokens.
    Its decode takes `max_tokens` steps, priced as full steps when requests wait ahead of it
    or lower lanes wait while a sequence slot is free (their prefill chunks then share its
    decode steps), else as steps of the running batch or the recent average step, whichever
    is longer. When more sequences are ahead than `max_num_seqs`, it waits one mean
    remaining decode per batch of them, rounded up. Aging lets each lower lane with work
    waiting put one request ahead every `aging_iterations` steps: those count as ahead too.
    """
    rank = LANE_RANK[request.lane]
    ahead = [r for lane in LANES[: rank + 1] for r in waiting.queue(lane)]
    lower = [waiting.queue(lane) for lane in LANES[rank + 1 :] if waiting.queue(lane)]
    batch = min(config.max_num_seqs, len(running) + len(ahead) + 1)
    full_step = costs.cost(budget, batch)
    # Requests waiting ahead of it, or lower lanes' while a sequence slot is free, are
    # admitted during its decode and their prefill chunks fill its steps; with every slot
    # taken, lower lanes get a slot only when one frees (the recent average covers those).
    slot_free = len(running) + len(ahead) + 1 < config.max_num_seqs
    filled = bool(ahead) or (len(waiting) > 0 and slot_free)
    decode_step = full_step if filled else costs.cost(batch, batch)
    if full_step is None or decode_step is None:
        return None
    decode_step = max(decode_step, costs.recent or 0.0)  # later arrivals' chunks share steps
    prefill_ahead = sum(r.num_tokens for r in ahead) + sum(
        max(0, r.num_prompt_tokens - r.num_computed_tokens) for r in running
    )
    remaining = [r.stop.max_tokens - r.num_output_tokens for r in (*running, *ahead)]
    mean_decode = sum(remaining) / len(remaining) if remaining else 0.0
    own = request.num_prompt_tokens / budget * full_step + request.stop.max_tokens * decode_step

    def wait_for(extra_seqs: int, extra_prefill: float) -> float:
        seqs = len(running) + len(ahead) + extra_seqs
        rounds = -(-max(0, seqs + 1 - config.max_num_seqs) // config.max_num_seqs)
        prefill = (prefill_ahead + extra_prefill) / budget * full_step
        return prefill + rounds * mean_decode * decode_step

    wait = wait_for(0, 0.0)
    if lower:
        steps = (wait + own) / min(full_step, decode_step)
        promoted = len(lower) * -(-int(steps) // config.aging_iterations)
        mean_prompt = sum(q[0].num_tokens for q in lower) / len(lower)
        wait = wait_for(promoted, promoted * mean_prompt)
    return FinishEstimate(wait, wait + own)


def check_deadline(request: Request, estimate: FinishEstimate | None, now: float) -> None:
    """Refuse ("deadline") a request whose deadline is earlier than its estimated finish."""
    if request.deadline is None or estimate is None or now + estimate.total <= request.deadline:
        return
    raise RequestRejected(
        "deadline",
        f"the deadline cannot be met: finishing is estimated to take {estimate.total:.2f} s "
        f"({estimate.wait:.2f} s of queued work ahead in lane {request.lane!r}, then "
        f"{request.num_prompt_tokens} prompt tokens and up to {request.stop.max_tokens} output "
        f"tokens), but the timeout leaves {max(0.0, request.deadline - now):.2f} s; retry "
        f"later, raise the timeout or lower max_tokens",
        retry_after=max(1.0, math.ceil(estimate.wait)),
    )


def check_kv_usage(usage: float, config: SchedulerConfig) -> None:
    """Refuse ("kv_full") new work while KV usage is above the reject watermark."""
    if usage > config.kv_reject_watermark:
        raise RequestRejected(
            "kv_full",
            f"KV cache usage is {usage:.1%}, above the reject watermark "
            f"{config.kv_reject_watermark:.1%} (kv_reject_watermark); retry later",
            retry_after=1.0,
        )
