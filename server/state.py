"""Per-app server state: the engine (None while it loads), settings, metrics, drain flag."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.web_protocol import RequestPayloadError

from jserve.outputs import EngineState
from jserve.server.api_errors import APIError
from jserve.server.engine_client import EngineClient
from jserve.server.metrics import ServerMetrics
from jserve.server.protocol import RequestPolicy
from jserve.server.settings import ServerSettings


class Health(StrEnum):
    """What /health answers: the engine's state, or the server's own (STARTING: the engine
    loads; DRAINING: shutting down). DEAD is followed by ": <reason>"."""

    STARTING = "starting"
    READY = EngineState.READY.value
    DRAINING = "draining"
    STOPPING = EngineState.STOPPING.value
    DEAD = EngineState.DEAD.value


@dataclass
class ServerState:
    engine: EngineClient | None
    settings: ServerSettings = field(default_factory=ServerSettings)
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)  # engine request ids being served
    cut: set[str] = field(default_factory=set)  # of those, the ones shutdown aborted
    start_error: str | None = None  # why the engine failed to start, if it did
    created: int = field(default_factory=lambda: int(time.time()))
    # Sampling parameters of fields requests leave out (--generation-config).
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def policy(self) -> RequestPolicy:
        """What the settings decide for every request (server/protocol.py)."""
        return RequestPolicy(
            self.settings.max_logprobs, self.settings.enable_auto_tool_choice,
            self.sampling_defaults, self.settings.trust_request_chat_template,
        )  # fmt: skip

    @property
    def body_timeout(self) -> float:
        """Seconds a request body may take to arrive."""
        return self.settings.body_timeout

    @property
    def stream_idle_timeout(self) -> float | None:
        """Seconds a stream's client may stop reading; None: wait forever."""
        return self.settings.stream_idle_timeout or None

    @property
    def model_name(self) -> str:
        if self.settings.served_model_name:
            return self.settings.served_model_name
        return self.engine.model_name if self.engine is not None else ""

    def health(self) -> str:
        """A Health value, DEAD as "dead: <reason>"."""
        if self.start_error is not None:
            return f"{Health.DEAD}: {self.start_error}"
        if self.draining:
            return Health.DRAINING
        if self.engine is None:
            return Health.STARTING
        if self.engine.state == EngineState.DEAD:
            return f"{Health.DEAD}: {self.engine.dead_reason or 'unknown reason'}"
        return Health(self.engine.state)

    def ready_engine(self) -> EngineClient:
        """The engine, or a 503 saying why requests cannot be served now."""
        health = self.health()
        if health == Health.READY:
            assert self.engine is not None
            return self.engine
        if health == Health.STARTING:
            raise APIError(
                503, "the model is still loading; retry shortly", code="starting",
                headers={"Retry-After": "5"},
            )  # fmt: skip
        if health in (Health.DRAINING, Health.STOPPING):
            raise APIError(503, "the server is shutting down", code="shutting_down")
        raise APIError(503, f"the engine is not serving ({health})", code="engine_dead")

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(
                404, f"model {model!r} does not exist; this server serves {self.model_name!r}",
                param="model", code="model_not_found",
            )  # fmt: skip


STATE = web.AppKey("jserve_state", ServerState)


def set_engine(app: web.Application, engine: EngineClient) -> None:
    """Install the engine once it has started (the app may already be serving /health)."""
    app[STATE].engine = engine


async def read_body(request: web.Request) -> bytes:
    """The request body's bytes, or a 4xx saying why they could not be read.

    The body must arrive within the app's body timeout (408 otherwise: a stalled client must
    not hold a handler forever); its size limit is enforced while reading (413).
    """
    timeout = request.app[STATE].body_timeout
    try:
        # Not asyncio.wait_for: on Python 3.11 it swallows a cancellation (the client left)
        # that lands as the read completes, and the abandoned request then runs to the end.
        async with asyncio.timeout(timeout):
            raw = await request.read()
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {timeout:g} s", code="request_timeout",
            close_connection=True,
        ) from None  # fmt: skip
    except (HttpProcessingError, RequestPayloadError) as exc:  # e.g. gzip that is not gzip
        cause = exc.__cause__ if isinstance(exc.__cause__, HttpProcessingError) else exc
        raise APIError(
            400, f"the request body could not be decoded: {type(cause).__name__}",
            code="bad_request_body", close_connection=True,
        ) from None  # fmt: skip
    return raw
