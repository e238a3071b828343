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
4. A second SIGINT while draining (Ctrl-C again) cuts the in-flight requests at once, as the
   timeout would, and the process exits 130. A stop while the engine is still starting does
   not wait for it (jserve.server.cli.serve_main leaves a loading thread behind).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

from aiohttp import web

from jserve.outputs import EngineState
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
    sampling_defaults: Mapping[str, Any] | None = None,
    stop: asyncio.Event | None = None,
) -> int:
    """Serve until SIGTERM/SIGINT (or `stop` is set); return the process exit code.
    `tenants` and `sampling_defaults` are create_app's."""
    app = create_app(None, settings, tenants=tenants, sampling_defaults=sampling_defaults)
    state = app[STATE]
    runner, listener = await start_listening(app, settings)
    bound_host, bound_port = listener.sockets[0].getsockname()[:2]
    logger.info("jserve listening on http://%s:%d", bound_host, bound_port)

    signals = _Signals(stop or asyncio.Event())
    engine_task = asyncio.create_task(engine_factory())
    exit_code = 1
    with signals:
        try:
            exit_code = await _serve(app, engine_task, signals.stop)
            if exit_code == 0:
                logger.info("draining in-flight requests (up to %.1f s)", settings.shutdown_timeout)
                state.draining = True
                await _drain(state, settings.shutdown_timeout, signals.force)
        finally:
            state.draining = True
            engine_task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await engine_task  # its outcome was handled by _serve
            listener.close()
            await runner.cleanup()
            if state.engine is not None:
                await state.engine.shutdown()
    if exit_code == 0 and signals.force.is_set():
        exit_code = 128 + signal.SIGINT  # 130: what a shell expects of an interrupted program
    logger.info("jserve stopped")
    return exit_code


class _Signals:
    """While entered: the first SIGTERM or SIGINT sets `stop` (drain); a SIGINT after it sets
    `force`: cut what is still in flight now, as a second Ctrl-C asks. A repeated SIGTERM
    changes nothing (supervisors escalate to SIGKILL themselves)."""

    def __init__(self, stop: asyncio.Event) -> None:
        self.stop = stop
        self.force = asyncio.Event()

    def __enter__(self) -> _Signals:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._received, sig)
        return self

    def __exit__(self, *exc_info: object) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)

    def _received(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            logger.info("%s: shutting down; a second SIGINT cuts in-flight requests", sig.name)
            self.stop.set()
        elif sig == signal.SIGINT and not self.force.is_set():
            logger.warning("second SIGINT: cutting in-flight requests and exiting now")
            self.force.set()


async def _serve(app: web.Application, engine_task: asyncio.Task, stop: asyncio.Event) -> int:
    """Install the engine once it has started and serve until `stop` is set: 0, or 1 if the
    engine failed to start or died (a stop while it is still starting is a 0)."""
    state = app[STATE]
    stop_task = asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({engine_task, stop_task}, return_when=asyncio.FIRST_COMPLETED)
        if not engine_task.done():
            logger.info("stopped while the engine was starting")
            return 0
        if engine_task.exception() is not None:
            state.start_error = f"engine failed to start: {engine_task.exception()!r}"
            logger.error("%s", state.start_error, exc_info=engine_task.exception())
            return 1
        engine = engine_task.result()
        set_engine(app, engine)
        logger.info("engine ready: serving %r", state.model_name)
        death_task = asyncio.create_task(_engine_death(engine))
        await asyncio.wait({stop_task, death_task}, return_when=asyncio.FIRST_COMPLETED)
        death_task.cancel()
        if engine.state == EngineState.DEAD:
            logger.error("the engine is dead (%s): exiting 1", engine.dead_reason)
            return 1
        return 0
    finally:
        stop_task.cancel()


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
    while engine.state != EngineState.DEAD:
        await asyncio.sleep(_POLL_SECONDS * 10)


async def _drain(state: ServerState, timeout: float, force: asyncio.Event) -> None:
    """Let in-flight requests finish for `timeout` s (or until `force` is set), then cut
    (abort) every one still going."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while state.in_flight and loop.time() < deadline and not force.is_set():
        await asyncio.sleep(min(_POLL_SECONDS, max(0.0, deadline - loop.time())))
    if not state.in_flight or state.engine is None:
        return
    why = "second SIGINT" if force.is_set() else "shutdown timeout"
    logger.warning("%s: cutting %d in-flight requests", why, len(state.in_flight))
    for request_id in list(state.in_flight):
        state.cut.add(request_id)
        await state.engine.abort(request_id)
    grace = loop.time() + _CUT_GRACE_SECONDS
    while state.in_flight and loop.time() < grace:
        await asyncio.sleep(_POLL_SECONDS)
