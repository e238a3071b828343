"""vLLM's /tokenize and /detokenize endpoints.

Tokenizing (and rendering a chat template) or decoding a long list may take seconds: both run
in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from jserve.config.validation import check_token_ids
from jserve.server.api_errors import APIError
from jserve.server.decoding import decode_request
from jserve.server.protocol import adds_generation_prompt, chat_messages, render_chat
from jserve.server.protocol_types import DetokenizeRequest, TokenizeRequest
from jserve.server.responses import json_response
from jserve.server.state import STATE, read_body


async def tokenize(request: web.Request) -> web.Response:
    """{"prompt"} or {"messages"} -> {"count", "max_model_len", "tokens"}."""
    state = request.app[STATE]
    engine = state.ready_engine()
    body = decode_request(await read_body(request), TokenizeRequest)
    state.check_model(body.model)
    tokenizer = engine.tokenizer
    if body.messages is not None:
        messages = chat_messages(body.messages)
        add_generation_prompt = adds_generation_prompt(body)
        continued = bool(body.continue_final_message)

        def encode() -> list[int]:
            text = render_chat(
                tokenizer, messages, add_generation_prompt, continue_final_message=continued
            )
            return tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))

    elif body.prompt is not None:
        prompt, add_special = body.prompt, body.add_special_tokens is not False

        def encode() -> list[int]:
            return tokenizer.encode(prompt, add_special_tokens=add_special)

    else:
        raise APIError(400, "send 'prompt' (a string) or 'messages' (a list)", param="prompt")
    tokens = await asyncio.to_thread(encode)
    return json_response(
        {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}
    )


async def detokenize(request: web.Request) -> web.Response:
    """{"tokens": [ids]} -> {"prompt": text}."""
    state = request.app[STATE]
    engine = state.ready_engine()
    body = decode_request(await read_body(request), DetokenizeRequest)
    state.check_model(body.model)

    def decode() -> str:
        return engine.tokenizer.decode(check_token_ids("tokens", body.tokens, engine.vocab_size))

    try:
        text = await asyncio.to_thread(decode)
    except ValueError as exc:
        raise APIError(400, str(exc), param="tokens") from exc
    return json_response({"prompt": text})


def add_tokenization_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
