"""/admin/scheduler: read and change the scheduler's settings at run time.

GET returns the adjustable settings (token budget, sequence cap, long-lane share, watermarks,
fairness policy, ITL target, tenant weights, whether the decision log is on) and, read-only,
the fair-share counters. POST takes a JSON object of changes and answers with the settings
after; a change outside what the engine precompiled, an unknown setting or tenant, or a value
of the wrong type or out of its declared range is a 400 whose `param` names the field, and
then nothing changed (jserve.core.control declares every field, validates and logs every
change). Both need the server's API key: without `--api-key` they answer 403, since anyone who
can reach the port could otherwise retune the engine.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from jserve.config.settings import InvalidSetting
from jserve.server.api_errors import APIError
from jserve.server.decoding import decode_request
from jserve.server.responses import json_response
from jserve.server.state import STATE, read_body


def _check_allowed(request: web.Request) -> None:
    if request.app[STATE].settings.api_key is None:
        raise APIError(
            403, "admin endpoints need the server to be started with --api-key",
            code="admin_disabled",
        )  # fmt: skip


async def get_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    return json_response(await engine.control({}))


async def post_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    changes = decode_request(await read_body(request), dict[str, Any])
    if not changes:
        raise APIError(400, "send a JSON object of settings to change", code="no_changes")
    try:
        settings = await engine.control(changes)
    except InvalidSetting as exc:
        raise APIError(400, str(exc), param=exc.name, code="invalid_setting") from exc
    return json_response(settings)


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/scheduler", get_scheduler)
    app.router.add_post("/admin/scheduler", post_scheduler)
