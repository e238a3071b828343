"""POST /v1/embeddings (OpenAI's shape): pooled, L2-normalized final hidden states.

Each input is one engine request with `PoolingParams` (the server's `--pooling-type`): it
goes through the same scheduler as generation, as a prefill that keeps no KV once pooled
(jserve.engine.pooling), so a batch of inputs is batched with everything else running. The
inputs of one body run concurrently; if one is refused or fails, the others are aborted and
the error names it (`input[i]`).
"""

from __future__ import annotations

import asyncio
import base64
import struct
import uuid
from collections.abc import Sequence

from aiohttp import web

from jserve.config.validation import check_token_ids
from jserve.errors import RequestRejected
from jserve.outputs import RequestOutput
from jserve.sampling_params import PoolingParams, SamplingParams, truncate_prompt
from jserve.server.api_errors import APIError, rejection_to_api_error
from jserve.server.decoding import decode_request
from jserve.server.engine_client import EngineClient, TokenizerLike
from jserve.server.protocol import request_tenant
from jserve.server.protocol_types import EmbeddingRequest, EncodingFormat
from jserve.server.responses import json_response
from jserve.server.state import STATE, read_body

_UNUSED = SamplingParams(max_tokens=1)  # an embedding request's params are not read


def _inputs(raw: str | list[str | int | list[int]]) -> list[str | list[int]]:
    """The body's inputs: one string, strings, one token-id list, or token-id lists."""
    if isinstance(raw, str):
        raw = [raw]
    elif raw and all(isinstance(t, int) for t in raw):
        return [list(raw)]  # type: ignore[arg-type]  # one prompt of token ids
    one_kind = all(isinstance(p, str) for p in raw) or all(isinstance(p, list) for p in raw)
    if not raw or not one_kind:
        raise APIError(
            400,
            "'input' must be a non-empty string, a list of strings, a list of token ids or a "
            "list of token-id lists",
            param="input",
        )
    for i, item in enumerate(raw):
        if not item:
            raise APIError(400, f"input[{i}] is empty", param=f"input[{i}]")
    return list(raw)  # type: ignore[arg-type]


def _encode(tokenizer: TokenizerLike, inputs: list[str | list[int]], vocab: int) -> list[list[int]]:
    """Token ids of every input (strings tokenized as completions' prompts are)."""
    out = []
    for i, item in enumerate(inputs):
        if isinstance(item, str):
            out.append(tokenizer.encode(item))
            continue
        try:
            out.append(check_token_ids(f"input[{i}]", item, vocab))
        except ValueError as exc:
            raise APIError(400, str(exc), param=f"input[{i}]") from exc
    return out


async def _embed(
    engine: EngineClient, ids: list[int], request_id: str, pooling: PoolingParams, tenant: str
) -> RequestOutput:
    async for output in engine.generate(
        ids, _UNUSED, request_id, tenant=tenant, pooling=pooling
    ):  # fmt: skip
        if output.finished:
            return output
    raise RuntimeError(f"embedding request {request_id} ended without a final output")


async def _embed_all(
    engine: EngineClient, prompts: list[list[int]], pooling: PoolingParams, tenant: str
) -> list[list[float]]:
    """Every prompt's embedding, run concurrently; the first failure aborts the rest."""
    base = f"embd-{uuid.uuid4().hex}"
    ids = [f"{base}-{i}" for i in range(len(prompts))]
    tasks = [
        asyncio.ensure_future(_embed(engine, p, rid, pooling, tenant))
        for p, rid in zip(prompts, ids, strict=True)
    ]
    try:
        outputs = await asyncio.gather(*tasks)
    except BaseException as exc:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for rid in ids:
            await engine.abort(rid)
        failed = next((i for i, t in enumerate(tasks) if _failed_with(t, exc)), 0)
        if isinstance(exc, RequestRejected):
            error = rejection_to_api_error(exc)
            raise APIError(
                error.status, f"input[{failed}]: {error.message}", param=f"input[{failed}]",
                code=error.code, headers=error.headers,
            ) from exc  # fmt: skip
        raise
    vectors = []
    for i, output in enumerate(outputs):
        if output.embedding is None:
            raise APIError(500, f"input[{i}] failed: {output.error}", code="request_failed")
        vectors.append(output.embedding)
    return vectors


def _failed_with(task: asyncio.Future, exc: BaseException) -> bool:
    return task.done() and not task.cancelled() and task.exception() is exc


def _encoded(vector: Sequence[float], encoding: EncodingFormat) -> list[float] | str:
    if encoding is EncodingFormat.BASE64:  # OpenAI's: little-endian float32 bytes
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return list(vector)


async def embeddings(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    body = decode_request(await read_body(request), EmbeddingRequest)
    state.check_model(body.model)
    if body.dimensions is not None and body.dimensions != engine.hidden_size:
        raise APIError(
            400,
            f"'dimensions' must be this model's hidden size, {engine.hidden_size}, or absent; "
            f"got {body.dimensions}",
            param="dimensions",
        )
    tenant = request_tenant(request.headers.get("X-Tenant"), body.user)
    inputs = _inputs(body.input)
    prompts = await asyncio.to_thread(_encode, engine.tokenizer, inputs, engine.vocab_size)
    try:
        keep = body.truncate_prompt_tokens
        prompts = [truncate_prompt(p, keep, engine.max_model_len) for p in prompts]
    except ValueError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens") from exc
    pooling = PoolingParams(state.settings.pooling_type)
    vectors = await _embed_all(engine, prompts, pooling, tenant)
    encoding = body.encoding_format or EncodingFormat.FLOAT
    num_tokens = sum(map(len, prompts))
    return json_response(
        {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": _encoded(v, encoding)}
                for i, v in enumerate(vectors)
            ],
            "model": state.model_name,
            "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
        }
    )


def add_embedding_routes(app: web.Application) -> None:
    app.router.add_post("/v1/embeddings", embeddings)
