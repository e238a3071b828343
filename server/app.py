"""The aiohttp application: app factory, middlewares and the small endpoints.

The engine hangs off the app as `app[STATE].engine`; it may be None while the model is still
loading (run_server starts the engine in the background and installs it with `set_engine`), so
/health can answer "starting" from the first second.

Middlewares, outermost first:
1. errors: APIError, aiohttp's HTTP errors (404, 405, 413) and any unexpected exception become
   OpenAI-style JSON bodies; nothing escapes as an HTML page or a dropped connection. (Requests
   aiohttp cannot even parse never reach a middleware: jserve.server.connections answers those.)
2. admission: while draining for shutdown every endpoint but /health and /metrics answers 503;
   with an API key set, every endpoint but /health and /metrics needs `Authorization: Bearer`.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from jserve.core.tenants import TenantLabels
from jserve.errors import EngineDeadError
from jserve.server.admin import add_admin_routes
from jserve.server.api_errors import APIError
from jserve.server.embeddings import add_embedding_routes
from jserve.server.engine_client import EngineClient
from jserve.server.generation import chat_completions, completions
from jserve.server.metrics import ServerMetrics
from jserve.server.models_api import add_model_routes
from jserve.server.responses import json_response
from jserve.server.responses_api import add_responses_routes
from jserve.server.settings import ServerSettings
from jserve.server.state import STATE, Health, ServerState
from jserve.server.tokenization import add_tokenization_routes
from jserve.server.worker_api import add_worker_routes

logger = logging.getLogger(__name__)

_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics"})

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except EngineDeadError as exc:
        return APIError(503, f"the engine died: {exc}", code="engine_dead").response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        message = exc.text or exc.reason
        if exc.status == 404:
            message = f"no route {request.method} {request.path}"
        elif exc.status == 405:
            message = f"method {request.method} is not allowed on {request.path}"
        elif exc.status == 413:
            limit = request.app[STATE].settings.max_body_bytes
            message = f"request body is larger than the limit of {limit} bytes"
        return APIError(exc.status, message, code=exc.reason.lower().replace(" ", "_")).response()
    except Exception:
        logger.exception("unexpected error serving %s %s", request.method, request.path)
        return APIError(500, "internal server error", code="internal_error").response()


@web.middleware
async def _admission_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    state = request.app[STATE]
    if request.path not in _OPEN_PATHS:
        if state.draining:
            raise APIError(503, "the server is shutting down", code="shutting_down")
        api_key = state.settings.api_key
        if api_key is not None:
            # aiohttp decodes header bytes that are not UTF-8 as surrogates: encode them back.
            supplied = request.headers.get("Authorization", "").encode("utf-8", "surrogateescape")
            if not hmac.compare_digest(supplied, f"Bearer {api_key}".encode()):
                raise APIError(
                    401, "invalid or missing API key; send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                )  # fmt: skip
    return await handler(request)


async def _health(request: web.Request) -> web.Response:
    state = request.app[STATE]
    health = state.health()
    body: dict[str, str | int] = {"status": health}
    restarts = state.engine.num_restarts if state.engine is not None else 0
    if restarts:  # the engine failed a step and recovered: operators should know
        body["engine_restarts"] = restarts
    return json_response(body, status=200 if health == Health.READY else 503)


async def _metrics(request: web.Request) -> web.Response:
    state = request.app[STATE]
    if state.engine is not None:
        try:
            engine = state.engine
            state.metrics.refresh(engine.stats())
            state.metrics.describe_engine(
                state.model_name, engine.quantization, engine.block_size,
                engine.kv_cache_dtype, engine.num_kv_blocks,
            )  # fmt: skip
        except Exception:  # a dead engine still lets operators read the server-side series
            logger.exception("engine.stats() failed; serving the last snapshot")
    body = state.metrics.render(state.model_name)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def create_app(
    engine: EngineClient | None,
    settings: ServerSettings = ServerSettings(),  # noqa: B008 (frozen: one shared default)
    *,
    tenants: tuple[str, ...] = (),
    sampling_defaults: Mapping[str, Any] | None = None,
) -> web.Application:
    """The OpenAI-compatible app. `engine=None` serves /health "starting" until set_engine().
    `tenants` are the declared ones (the tenants file's), which always get a metric label;
    `sampling_defaults` are the defaults --generation-config read
    (jserve.server.generation_config).

    Serve it with handler_cancellation=True (run_server and aiohttp's TestServer do) so a
    client that disconnects cancels its handler, which aborts the engine request at once.
    """
    app = web.Application(
        middlewares=[_error_middleware, _admission_middleware],
        client_max_size=settings.max_body_bytes,
    )
    metrics = ServerMetrics(TenantLabels(tenants, settings.max_tenant_labels))
    app[STATE] = ServerState(engine, settings, metrics, sampling_defaults=sampling_defaults or {})
    app.router.add_get("/health", _health)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/ping", _health)  # vLLM's (and SageMaker's) name for /health
    app.router.add_post("/ping", _health)
    add_model_routes(app)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    add_tokenization_routes(app)
    add_embedding_routes(app)
    add_worker_routes(app)
    add_admin_routes(app)
    add_responses_routes(app)
    return app
