"""GET /v1/models and GET /v1/models/{id}: the served model's card, as OpenAI and vLLM list it.

One model is served, under its served name; any other id is a 404 with an OpenAI error body
(`code` "model_not_found", `param` "model"), as the generation endpoints answer for it.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from jserve.server.responses import json_response
from jserve.server.state import STATE, ServerState


def model_card(state: ServerState) -> dict[str, Any]:
    """The served model as a /v1/models entry; a 503 while the engine cannot serve."""
    engine = state.ready_engine()
    return {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "jserve",
        "max_model_len": engine.max_model_len,
        "quantization": engine.quantization,
    }


async def _list_models(request: web.Request) -> web.Response:
    return json_response({"object": "list", "data": [model_card(request.app[STATE])]})


async def _get_model(request: web.Request) -> web.Response:
    state = request.app[STATE]
    card = model_card(state)
    state.check_model(request.match_info["model_id"])
    return json_response(card)


def add_model_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", _list_models)
    app.router.add_get("/v1/models/{model_id:.+}", _get_model)
