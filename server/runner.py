"""Serve the app: listen first, start the engine in the background, drain on SIGTERM.

Walkthrough:
1. Bind the socket at once, with no engine: /health answers 503 "starting" while the engine
   factory loads and compiles the model.
2. When the factory returns, install the engine: /health turns 200 "ready". If the factory
   raises, log why and exit 1 (a server that can never serve should not linger).
3. On SIGTERM or SIGINT: mark the server draining (any request that still arrives on an open
   connection gets 503 "shutting_down"), stop listening, let in-flight requests finish for up
   to `shutdown_timeout` seconds (aiohttp then cancels the rest, which aborts their engine
   requests), shut the engine down, and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

from aiohttp import web

from server.app import DEFAULT_MAX_BODY_BYTES, create_app
from server.engine_client import EngineClient
from server.state import STATE, set_engine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[], Awaitable[EngineClient]]


async def run_server(
    engine_factory: EngineFactory,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    shutdown_timeout: float = 30.0,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set); return the process exit code."""
    app = create_app(
        None, api_key=api_key, served_model_name=served_model_name, max_body_bytes=max_body_bytes
    )
    state = app[STATE]
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=shutdown_timeout)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    bound_host, bound_port = runner.addresses[0][:2]
    logger.info("jserve listening on http://%s:%d", bound_host, bound_port)

    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
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
            await stop_task
        logger.info("shutting down: draining in-flight requests (up to %.0f s)", shutdown_timeout)
    finally:
        state.draining = True
        stop_task.cancel()
        engine_task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await engine_task  # its outcome was handled above
        await runner.cleanup()
        if state.engine is not None:
            await state.engine.shutdown()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    logger.info("jserve stopped")
    return exit_code
