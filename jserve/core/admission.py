"""Admission checks for a new request; each failure names the reason a server maps to a status."""

from __future__ import annotations

from collections.abc import Container

from jserve.config import SchedulerConfig
from jserve.core.request import LANES, Request
from jserve.errors import RequestRejected


def check_new_request(
    request: Request,
    config: SchedulerConfig,
    known_request_ids: Container[str],
    num_waiting: int,
) -> None:
    """Raise RequestRejected unless `request` may join the waiting queue.

    `num_waiting` counts sequences: each sample of an `n > 1` request is one, so a request
    with many samples meets the cap like as many requests (it cannot slip past it).
    """
    if request.request_id in known_request_ids:
        raise RequestRejected(
            "invalid", f"request id {request.request_id!r} is already in use; use a unique id"
        )
    if request.num_prompt_tokens == 0:
        raise RequestRejected("invalid", "the prompt has no tokens; send at least one token")
    if request.max_tokens < 1 or request.min_tokens < 0:
        raise RequestRejected(
            "invalid",
            f"max_tokens must be >= 1 and min_tokens >= 0, got max_tokens={request.max_tokens}, "
            f"min_tokens={request.min_tokens}",
        )
    if request.lane not in LANES:
        raise RequestRejected("invalid", f"lane must be one of {LANES}, got {request.lane!r}")
    total = request.num_prompt_tokens + request.max_tokens
    if total > config.max_model_len:
        raise RequestRejected(
            "too_long",
            f"the prompt has {request.num_prompt_tokens} tokens and max_tokens is "
            f"{request.max_tokens}: {total} tokens exceed max_model_len={config.max_model_len}; "
            f"shorten the prompt or lower max_tokens",
        )
    if num_waiting >= config.max_waiting_requests:
        raise RequestRejected(
            "queue_full",
            f"{num_waiting} sequences are already waiting (max_waiting_requests="
            f"{config.max_waiting_requests}, each of a request's n samples counts); retry later",
        )
