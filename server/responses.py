"""JSON response bodies that are always valid JSON.

Python's json writes non-finite floats as the bare words NaN and Infinity, which are not JSON
and which strict clients refuse to parse; `dump_json` raises ValueError instead, so such a
value surfaces as a server error (500, or an error event in a stream) rather than a body the
client cannot read.
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web


def dump_json(payload: Any) -> str:
    return json.dumps(payload, ensure_ascii=False, allow_nan=False)


def json_response(
    payload: Any, *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.json_response(payload, status=status, headers=headers, dumps=dump_json)
