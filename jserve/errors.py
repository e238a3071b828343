"""Exceptions shared by the engine and its callers (pure Python, importable anywhere)."""

from __future__ import annotations


class RequestRejected(ValueError):
    """A request the engine will not accept.

    `reason` is machine-readable so a server can map it to a status code:
    "too_long" and "invalid" are the caller's fault (HTTP 400), "queue_full" is back-pressure
    (HTTP 429), "shutting_down" means the engine no longer admits work (HTTP 503).
    """

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class EngineDeadError(RuntimeError):
    """The engine's step loop failed; every in-flight request fails with this error."""
