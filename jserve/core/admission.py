"""Admission checks for a new request; each failure names the reason a server maps to a status."""

from __future__ import annotations

from jserve.config import LANES, SchedulerConfig
from jserve.core.request import Request
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
