"""Exceptions shared by the engine and its callers (pure Python, importable anywhere)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from enum import StrEnum


class RejectReason(StrEnum):
    """Why the engine refused a request, machine-readable so a server can map it to a status:
    TOO_LONG and INVALID are the caller's fault (HTTP 400), QUEUE_FULL and DEADLINE (the
    deadline cannot be met) are back-pressure (HTTP 429), KV_FULL (KV usage above the reject
    watermark) and SHUTTING_DOWN mean the engine admits no work now (HTTP 503)."""

    TOO_LONG = "too_long"
    INVALID = "invalid"
    QUEUE_FULL = "queue_full"
    DEADLINE = "deadline"
    KV_FULL = "kv_full"
    SHUTTING_DOWN = "shutting_down"


class RequestRejected(ValueError):
    """A request the engine will not accept, and `reason` why (see RejectReason).

    `retry_after` is the seconds after which a retry may succeed, when that is known.
    """

    def __init__(
        self,
        reason: RejectReason,
        message: str,
        retry_after: float | None = None,
        *,
        param: str | None = None,
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after
        self.param = param  # the request field at fault, by SamplingParams' name, if one is


@contextmanager
def invalid_param(param: str) -> Iterator[None]:
    """A ValueError raised inside becomes RequestRejected INVALID naming `param` (a
    RequestRejected passes as it is)."""
    try:
        yield
    except RequestRejected:
        raise
    except ValueError as e:
        raise RequestRejected(RejectReason.INVALID, str(e), param=param) from None


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; every in-flight request fails with this error."""
