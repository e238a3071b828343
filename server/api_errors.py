"""OpenAI-style error bodies, and how engine exceptions map to HTTP statuses."""

from __future__ import annotations

import math
from collections.abc import Mapping

from aiohttp import web

from jserve.errors import RejectReason, RequestRejected
from jserve.server.responses import json_response

# Seconds a client should wait before retrying a request refused for a full queue.
RETRY_AFTER_SECONDS = 1
# Longest error message (and `param`) sent: whatever they quote of the input, the body stays
# small.
MAX_MESSAGE_CHARS = 512

_TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


def _capped(text: str) -> str:
    if len(text) <= MAX_MESSAGE_CHARS:
        return text
    return text[: MAX_MESSAGE_CHARS - 1] + "…"


class APIError(Exception):
    """An error that becomes an OpenAI-style JSON response. Its message and param are cut to
    MAX_MESSAGE_CHARS; quote input in a message with jserve.config.validation.show."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        close_connection: bool = False,
    ) -> None:
        message = _capped(message)
        super().__init__(message)
        self.close_connection = close_connection  # the rest of the request cannot be read
        self.status = status
        self.message = message
        self.param = None if param is None else _capped(param)
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _TYPE_BY_STATUS.get(self.status, "server_error"),
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> web.Response:
        response = json_response(self.body(), status=self.status, headers=self.headers)
        if self.close_connection:
            response.force_close()
        return response


def _retry_after(exc: RequestRejected) -> dict[str, str]:
    seconds = RETRY_AFTER_SECONDS if exc.retry_after is None else math.ceil(exc.retry_after)
    return {"Retry-After": str(seconds)}


def rejection_to_api_error(
    exc: RequestRejected, fields: Mapping[str, str] | None = None
) -> APIError:
    """Map the engine's admission refusal to the status the client should act on: overload
    a retry can fix is 429 (queue full, a deadline the queue ahead makes unmeetable) or 503
    (KV cache above its reject watermark), each with Retry-After; the message says which
    limit refused it and the numbers. An invalid request's 400 names the field at fault:
    the engine names it as SamplingParams does, `fields` maps such a name to the request's
    own field where they differ (max_tokens sent as max_completion_tokens, a constraint sent
    as response_format)."""
    if exc.reason == RejectReason.QUEUE_FULL:
        return APIError(429, str(exc), code="queue_full", headers=_retry_after(exc))
    if exc.reason == RejectReason.DEADLINE:
        return APIError(429, str(exc), code="deadline_unmeetable", headers=_retry_after(exc))
    if exc.reason == RejectReason.KV_FULL:
        return APIError(503, str(exc), code="kv_cache_full", headers=_retry_after(exc))
    if exc.reason == RejectReason.SHUTTING_DOWN:
        return APIError(503, str(exc), code="shutting_down")
    if exc.reason == RejectReason.TOO_LONG:
        return APIError(400, str(exc), param="prompt", code="context_length_exceeded")
    param = exc.param if exc.param is None or fields is None else fields.get(exc.param, exc.param)
    return APIError(400, str(exc), param=param, code=str(exc.reason))
