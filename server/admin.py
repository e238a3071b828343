"""/admin/scheduler: read and change the scheduler's settings at run time.

GET returns the adjustable settings (token budget, sequence cap, long-lane share, watermarks,
fairness policy, ITL target, tenant weights, whether the decision log is on) and, read-only,
the fair-share counters. POST takes a JSON object of changes and answers with the settings
after; a change outside what the engine precompiled, an unknown setting or tenant, or a value
out of range is a 400 naming it, and then nothing changed (jserve.core.control validates and
logs every change). Both need the server's API key: without `--api-key` they answer 403, since
anyone who can reach the port could otherwise retune the engine.
"""

from __future__ import annotations

from aiohttp import web

from jserve.server.api_errors import APIError
from jserve.server.state import STATE, read_json_object


def _check_allowed(request: web.Request) -> None:
    if request.app[STATE].api_key is None:
        raise APIError(
            403, "admin endpoints need the server to be started with --api-key",
            code="admin_disabled",
        )  # fmt: skip


async def get_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    return web.json_response(await engine.control({}))


async def post_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    changes = await read_json_object(request)
    if not changes:
        raise APIError(400, "send a JSON object of settings to change", code="no_changes")
    try:
        return web.json_response(await engine.control(changes))
    except ValueError as exc:
        raise APIError(400, str(exc), code="invalid_setting") from exc


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/scheduler", get_scheduler)
    app.router.add_post("/admin/scheduler", post_scheduler)
