"""Serve the app: listen first, start the engine in the background, drain on SIGTERM.

Walkthrough:
1. Bind the socket at once, with no engine: /health answers 503 "starting" while the engine
   factory loads and compiles the model. Connections go through jserve.server.connections' guarded
   handler (header and keep-alive timeouts, half-open cap, JSON for aiohttp's own errors).
2. When the factory returns, install the engine: /health turns 200 "ready". If the factory
   raises, log why and exit 1 (a server that can never serve should not linger). If the engine
   dies later (a failed step it could not restart from), exit 1 too, so a supervisor restarts
   the process.
3. On SIGTERM or SIGINT, drain: /health answers 503 "draining" and every other request that
   arrives gets 503 "shutting_down", but the listener stays up so load balancers can see it.
   In-flight requests may finish for up to `shutdown_timeout` seconds; at that moment every
   one still running is aborted (its KV freed), and its stream ends with an error event then
   [DONE] (a non-streaming one gets a 503). Then stop listening, close the connections, shut
   the engine down and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from jserve.server.app import create_app
from jserve.server.connections import handler_factory
from jserve.server.engine_client import EngineClient
from jserve.server.settings import ServerSettings
from jserve.server.state import STATE, ServerState, set_engine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[EngineClient]]
_CUT_GRACE_SECONDS = 2.0  # for cut handlers to write their error event and [DONE]
_POLL_SECONDS = 0.05


async def run_server(
    engine_factory: EngineFactory,
    settings: ServerSettings,
    *,
    tenants: tuple[str, ...] = (),
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set); return the process exit code.
    `tenants` are the declared ones (see create_app)."""
    app = create_app(None, settings, tenants=tenants)
    state = app[STATE]
    runner, listener = await start_listening(app, settings)
    bound_host, bound_port = listener.sockets[0].getsockname()[:2]
    logger.info("jserve listening on http://%s:%d", bound_host, bound_port)

    loop = asyncio.get_running_loop()
    stop = stop or asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    exit_code = 0
    engine_task = asyncio.create_task(engine_factory())
    stop_task = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if engine_task.done() and engine_task.exception() is not None:
            state.start_error = f"engine failed to start: {engine_task.exception()!r}"
            logger.error("%s", state.start_error, exc_info=engine_task.exception())
            exit_code = 1
        elif engine_task.done():
            set_engine(app, engine_task.result())
            logger.info("engine ready: serving %r", state.model_name)
            death_task = asyncio.create_task(_engine_death(engine_task.result()))
            await asyncio.wait({stop_task, death_task}, return_when=asyncio.FIRST_COMPLETED)
            death_task.cancel()
            if state.engine is not None and state.engine.state == "dead":
                logger.error("the engine is dead (%s): exiting 1", state.engine.dead_reason)
                exit_code = 1
        if exit_code == 0:
            logger.info("draining in-flight requests (up to %.1f s)", settings.shutdown_timeout)
            state.draining = True
            await _drain(state, settings.shutdown_timeout)
    finally:
        state.draining = True
        stop_task.cancel()
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await engine_task  # its outcome was handled above
        listener.close()
        await runner.cleanup()
        if state.engine is not None:
            await state.engine.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    logger.info("jserve stopped")
    return exit_code


async def start_listening(
    app: web.Application, settings: ServerSettings
) -> tuple[web.AppRunner, asyncio.Server]:
    """Set `app` up and listen on `settings`' host and port through the guarded handler; the
    caller closes the listener, then cleans the runner up (cancelling handlers still running
    after a short grace)."""
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=_CUT_GRACE_SECONDS)
    await runner.setup()
    assert runner.server is not None
    factory = handler_factory(
        runner.server, header_timeout=settings.header_timeout,
        keepalive_timeout=settings.keepalive_timeout,
        max_half_open=settings.max_half_open_connections,
    )  # fmt: skip
    loop = asyncio.get_running_loop()
    return runner, await loop.create_server(
        factory, settings.host, settings.port, reuse_address=True
    )


async def _engine_death(engine: EngineClient) -> None:
    """Returns once the engine is dead (it has no event to wait on: poll its state)."""
    while engine.state != "dead":
        await asyncio.sleep(_POLL_SECONDS * 10)


async def _drain(state: ServerState, timeout: float) -> None:
    """Let in-flight requests finish for `timeout` s, then cut (abort) every one still going."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight and loop.time() < deadline:
        await asyncio.sleep(min(_POLL_SECONDS, max(0.0, deadline - loop.time())))
    if not state.in_flight or state.engine is None:
        return
    logger.warning("shutdown timeout: cutting %d in-flight requests", len(state.in_flight))
    for request_id in list(state.in_flight):
        state.cut.add(request_id)
        await state.engine.abort(request_id)
    grace = loop.time() + _CUT_GRACE_SECONDS
    while state.in_flight and loop.time() < grace:
        await asyncio.sleep(_POLL_SECONDS)
