"""Exceptions shared by the engine and its callers (pure Python, importable anywhere)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine will not accept.

    `reason` is machine-readable so a server can map it to a status code:
    "too_long" and "invalid" are the caller's fault (HTTP 400), "queue_full" and "deadline"
    (the deadline cannot be met) are back-pressure (HTTP 429), "kv_full" (KV usage above the
    reject watermark) and "shutting_down" mean the engine admits no work now (HTTP 503).
    `retry_after` is the seconds after which a retry may succeed, when that is known.
    """

    def __init__(self, reason: str, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.reason = reason
        self.retry_after = retry_after


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; every in-flight request fails with this error."""
