"""Connection-level defences: slow clients, half-open connections, JSON for aiohttp's own errors.

aiohttp answers a request it cannot parse (bad framing, an over-long header line, an unknown
Content-Encoding) itself, before any middleware runs, with a plain-text body that can quote
the offending header back. `GuardedRequestHandler.handle_error` answers with an OpenAI-style
JSON error instead, and quotes nothing the client sent.

Slow clients, in the order a connection meets them:
1. Half-open cap: a connection is half-open until the head (request line and headers) of its
   first request is complete. A new connection past `max_half_open` of them evicts the oldest
   (the slowest sender, likely a trickling attacker, not a client of a burst whose head is
   milliseconds away), so trickling clients can neither take every file descriptor nor lock
   new clients out.
2. Header timeout: a connection whose first request head is not complete `header_timeout`
   seconds after it opened is closed, however slowly its bytes trickle in.
3. Keep-alive timeout: aiohttp's keep-alive timer closes a connection with no new complete
   request head `keepalive_timeout` seconds after its previous response (partial heads do not
   restart it either). It is long (75 s, as nginx) on purpose: a client reusing a pooled
   connection just as the server closes it loses that request, so the server's idle limit must
   outlast clients' pools (httpx keeps idle connections 5 s, aiohttp 15 s).
4. Body timeout: `read_body` answers 408 (and closes) when a body stalls.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from aiohttp import web
from aiohttp.http_exceptions import ContentEncodingError, HttpProcessingError, LineTooLong
from aiohttp.web_protocol import RequestPayloadError

from jserve.server.api_errors import APIError

logger = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"
# After answering a request whose body was not read (413, 408), aiohttp reads and drops what the
# client still sends, so its close does not reset the connection before the client reads the
# answer. Its default of 10 s would let a stalled client hold the connection: 2 s suffices.
_LINGER_SECONDS = 2.0


class GuardedRequestHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, plus the half-open cap and JSON error bodies."""

    def __init__(
        self,
        manager: web.Server,
        *,
        half_open: dict,
        max_half_open: int,
        header_timeout: float,
        **kwargs,
    ) -> None:
        super().__init__(manager, **kwargs)
        self._half_open = half_open  # shared by the listener's connections, oldest first
        self._max_half_open = max_half_open
        self._header_timeout = header_timeout
        self._head_timer: asyncio.TimerHandle | None = None
        self._head_tail: bytes | None = b""  # None once the first request head is complete

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        loop = asyncio.get_running_loop()
        self._head_timer = loop.call_later(self._header_timeout, self._head_timed_out)
        if len(self._half_open) >= self._max_half_open:
            oldest = next(iter(self._half_open))
            del self._half_open[oldest]
            logger.warning("%d half-open connections: closing the oldest", self._max_half_open)
            oldest.force_close()
        self._half_open[self] = None

    def connection_lost(self, exc: BaseException | None) -> None:
        self._head_complete()
        super().connection_lost(exc)

    def _head_complete(self) -> None:
        self._head_tail = None
        self._half_open.pop(self, None)
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._head_tail is not None:
            self.force_close()

    def data_received(self, data: bytes) -> None:
        if self._head_tail is not None:
            # Look for the end of the first head across chunk boundaries (a trickle of bytes).
            seen = self._head_tail + data
            if _HEAD_END in seen:
                self._head_complete()
            else:
                self._head_tail = seen[-(len(_HEAD_END) - 1) :]
        super().data_received(data)

    def log_exception(self, *args, **kwargs) -> None:
        """A body that does not decode is the client's mistake (it got its 400): one line, no
        traceback, so such requests cannot flood the log."""
        error = kwargs.get("exc_info")
        if isinstance(error, HttpProcessingError | RequestPayloadError):
            logger.info("dropped the rest of an undecodable request body: %r", error)
        else:
            super().log_exception(*args, **kwargs)

    def handle_error(
        self,
        request: web.BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        """The error response aiohttp itself sends for an unparseable request, as JSON."""
        if request.writer.output_size > 0:  # as aiohttp does: too late for a response
            raise ConnectionError("the response has started; cannot send an error response")
        logger.info("refused a malformed request: %s", type(exc).__name__ if exc else status)
        if isinstance(exc, LineTooLong):
            error = APIError(431, "the request line or a header field is too long")
        elif isinstance(exc, ContentEncodingError):
            error = APIError(
                400, "the request's Content-Encoding is not supported", param="Content-Encoding"
            )
        elif status >= 500:
            error = APIError(500, "internal server error", code="internal_error")
        else:
            error = APIError(status, "malformed HTTP request", code="bad_request")
        response = error.response()
        response.force_close()
        return response


def handler_factory(
    server: web.Server,
    *,
    header_timeout: float,
    keepalive_timeout: float,
    max_half_open: int,
) -> Callable[[], GuardedRequestHandler]:
    """A protocol factory for `loop.create_server` serving `server` (an AppRunner's)."""
    half_open: dict[GuardedRequestHandler, None] = {}  # insertion order: oldest first
    loop = asyncio.get_running_loop()

    def make() -> GuardedRequestHandler:
        return GuardedRequestHandler(
            server, half_open=half_open, max_half_open=max_half_open,
            header_timeout=header_timeout, loop=loop, keepalive_timeout=keepalive_timeout,
            lingering_time=_LINGER_SECONDS,
        )  # fmt: skip

    return make
