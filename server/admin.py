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

import functools
import json

from aiohttp import web

from jserve.config.settings import InvalidSetting
from jserve.server.api_errors import APIError
from jserve.server.state import STATE, read_json_object

# Only JSON numbers go out: a value that is not finite is a 500, never an `Infinity` body.
_STRICT_JSON = functools.partial(json.dumps, allow_nan=False)


def _check_allowed(request: web.Request) -> None:
    if request.app[STATE].settings.api_key is None:
        raise APIError(
            403, "admin endpoints need the server to be started with --api-key",
            code="admin_disabled",
        )  # fmt: skip


async def get_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    return web.json_response(await engine.control({}), dumps=_STRICT_JSON)


async def post_scheduler(request: web.Request) -> web.Response:
    _check_allowed(request)
    engine = request.app[STATE].ready_engine()
    changes = await read_json_object(request)
    if not changes:
        raise APIError(400, "send a JSON object of settings to change", code="no_changes")
    try:
        settings = await engine.control(changes)
    except InvalidSetting as exc:
        raise APIError(400, str(exc), param=exc.name, code="invalid_setting") from exc
    return web.json_response(settings, dumps=_STRICT_JSON)


def add_admin_routes(app: web.Application) -> None:
    app.router.add_get("/admin/scheduler", get_scheduler)
    app.router.add_post("/admin/scheduler", post_scheduler)
