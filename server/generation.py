"""/v1/completions and /v1/chat/completions: one engine request per HTTP request.

Walkthrough of one request:
1. Check the engine is ready, decode the body into its protocol Struct and parse that (a 400
   naming any bad field: server/decoding.py, server/protocol.py), check the model name, then
   render and tokenize the prompt in a worker thread (megabytes of text take long; the event
   loop must keep serving every other stream meanwhile).
2. Start `engine.generate` and wait for its first output *before* answering, so a refusal
   (queue full, prompt too long) still gets its own status code (429, 400) instead of an error
   buried in a 200 stream.
3. Stream SSE chunks of what is new per choice (or wait for the final output and answer once).
4. A request that ended badly (cut by shutdown, or failed in the engine) ends a stream with an
   error event, then [DONE]; without streaming it is a 503 or 500 JSON error.
5. However the handler ends before the final output (client disconnect cancels the handler;
   a failed write raises; a write the client does not read for `--stream-idle-timeout`
   seconds raises StreamIdle; shutdown cancels it after the drain timeout), `finally` aborts
   the engine request, which frees its KV blocks at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator

import msgspec
from aiohttp import web

from jserve.engine.beam_search import beam_search
from jserve.errors import EngineDeadError, RejectReason, RequestRejected
from jserve.outputs import RequestOutput
from jserve.sampling_params import BeamSearchParams
from jserve.server.api_errors import APIError, rejection_to_api_error
from jserve.server.decoding import decode_request
from jserve.server.engine_client import EngineClient
from jserve.server.metrics import RequestTracker, ServerMetrics
from jserve.server.openai_format import ChoiceCursor, Endpoint, ResponseBuilder, choice_usage
from jserve.server.protocol import (
    ParsedRequest,
    encode_prompt,
    parse_chat,
    parse_completion,
    request_tenant,
)
from jserve.server.protocol_types import (
    ChatRequest,
    CompletionRequest,
    RequestIdText,
    StreamUsage,
)
from jserve.server.responses import dump_json, json_response
from jserve.server.state import STATE, ServerState, read_body

logger = logging.getLogger(__name__)


class StreamIdle(ConnectionError):
    """The client stopped reading its stream for longer than the stream idle timeout."""


async def write_stream(
    response: web.StreamResponse, data: bytes, idle_timeout: float | None
) -> None:
    """Write, waiting at most `idle_timeout` seconds for a client that stopped reading (the
    write blocks once the socket's buffers are full)."""
    try:
        async with asyncio.timeout(idle_timeout):
            await response.write(data)
    except TimeoutError:
        logger.warning("client stopped reading for %g s: aborting its request", idle_timeout)
        raise StreamIdle(f"no read for {idle_timeout:g} s") from None


def _sse(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else dump_json(payload)
    return f"data: {data}\n\n".encode()


def _beam_search_params(
    parsed: ParsedRequest, engine: EngineClient, num_prompt_tokens: int
) -> BeamSearchParams:
    """The request's beam search: `n` beams of up to max_tokens (None: what the context
    window leaves) at its temperature; a value out of range is a 400 naming the field."""
    params = parsed.params
    max_tokens = params.max_tokens or max(1, engine.max_model_len - num_prompt_tokens)
    try:
        return BeamSearchParams(
            beam_width=params.n, max_tokens=max_tokens, ignore_eos=params.ignore_eos,
            temperature=params.temperature, length_penalty=parsed.length_penalty,
            include_stop_str_in_output=params.include_stop_str_in_output,
        )  # fmt: skip
    except ValueError as exc:  # the messages start with the field's name
        field, message = str(exc).split()[0], str(exc)
        if field == "beam_width":  # the request's n
            field, message = "n", "n" + message.removeprefix("beam_width")
        raise APIError(400, message, param=field) from exc


class Generation:
    """One engine request: admission, tracked outputs, and abort unless it finished."""

    def __init__(
        self,
        engine: EngineClient,
        parsed: ParsedRequest,
        prompt_ids: list[int],
        request_id: str,
        metrics: ServerMetrics,
        tenant: str,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.num_choices = parsed.params.n
        self.metrics = metrics
        self.lane, self.tenant = parsed.lane, tenant
        self.fields = parsed.fields
        self.tracker = RequestTracker(metrics, parsed.lane, tenant)
        self.final: RequestOutput | None = None
        self.rejected = False
        if parsed.use_beam_search:
            self.outputs = beam_search(
                engine, prompt_ids, _beam_search_params(parsed, engine, len(prompt_ids)),
                request_id, cache_salt=parsed.cache_salt, timeout=parsed.timeout,
                lane=parsed.lane, tenant=tenant,
            )  # fmt: skip
            return
        prompt: list[int] | dict = prompt_ids
        if parsed.cache_salt is not None:  # the engine's dict form carries it
            prompt = {"prompt_token_ids": prompt_ids, "cache_salt": parsed.cache_salt}
        self.outputs = engine.generate(
            prompt,
            parsed.params,
            request_id,
            lane=parsed.lane,
            timeout=parsed.timeout,
            tenant=tenant,
        )

    def _seen(self, output: RequestOutput) -> RequestOutput:
        self.tracker.on_output(output)
        if output.finished:
            self.final = output
            self.tracker.on_finish(output)
        return output

    async def first(self) -> RequestOutput:
        try:
            return self._seen(await anext(self.outputs))
        except RequestRejected as exc:
            self.rejected = True
            self.metrics.rejected(exc.reason, self.lane, self.tenant)
            raise rejection_to_api_error(exc, self.fields) from exc

    async def rest(self) -> AsyncIterator[RequestOutput]:
        async for output in self.outputs:
            yield self._seen(output)

    async def release(self) -> None:
        """Abort the engine request unless it finished (or was never admitted)."""
        if self.final is None and not self.rejected:
            self.tracker.on_client_gone(self.num_choices)
            try:
                # Shielded: this runs while the handler is being cancelled.
                await asyncio.shield(self.engine.abort(self.request_id))
            except Exception:
                logger.exception("abort of %s failed", self.request_id)
        aclose = getattr(self.outputs, "aclose", None)
        if aclose is not None:  # run an async generator's cleanup now, not at GC time
            await aclose()


@contextlib.asynccontextmanager
async def tracked(state: ServerState, gen: Generation) -> AsyncIterator[Generation]:
    """Serve `gen` as one of the server's in-flight requests (shutdown waits for them and
    may cut them); however serving it ends, release it (step 5 above)."""
    state.in_flight.add(gen.request_id)
    try:
        yield gen
    finally:
        state.in_flight.discard(gen.request_id)
        state.cut.discard(gen.request_id)
        await gen.release()


def request_failure(gen: Generation, state: ServerState) -> APIError | None:
    """Why a request that ended did not end well, if it did not: cut by shutdown, or failed in
    the engine (its own host-side step failed, or a failed device step restarted the engine)."""
    if gen.request_id in state.cut:
        return APIError(
            503, "the server shut down before this request finished", code="shutting_down"
        )
    if gen.final is not None and gen.final.error is not None:
        return APIError(500, f"the request failed: {gen.final.error}", code="request_failed")
    return None


async def _stream(
    request: web.Request, gen: Generation, builder: ResponseBuilder, usage: StreamUsage
) -> web.StreamResponse:
    first = await gen.first()
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)
    cursors = [ChoiceCursor() for _ in range(gen.num_choices)]
    idle_timeout = request.app[STATE].stream_idle_timeout

    async def send(output: RequestOutput) -> None:
        for choice in output.outputs:
            chunk = builder.delta_chunk(choice, cursors[choice.index], output)
            if chunk is not None:
                if usage is StreamUsage.FINAL:
                    chunk["usage"] = None
                elif usage is StreamUsage.EVERY_CHUNK:  # vLLM's: this choice's tokens so far
                    chunk["usage"] = choice_usage(output, choice)
                await write_stream(response, _sse(chunk), idle_timeout)

    try:
        await send(first)
        async for output in gen.rest():
            await send(output)
    except ConnectionError:
        raise  # the client is gone; nobody to tell
    except EngineDeadError as exc:
        # Headers are gone already: report in-band the way OpenAI-compatible servers do.
        await write_stream(
            response, _sse(APIError(503, f"the engine died: {exc}").body()), idle_timeout
        )
    except Exception:
        logger.exception("request %s failed mid-stream", gen.request_id)
        await write_stream(
            response, _sse(APIError(500, "internal server error").body()), idle_timeout
        )
    else:
        failure = request_failure(gen, request.app[STATE])
        if failure is not None:  # an error event the OpenAI client raises, then [DONE]
            await write_stream(response, _sse(failure.body()), idle_timeout)
        elif usage is not StreamUsage.NONE and gen.final is not None:
            await write_stream(response, _sse(builder.usage_chunk(gen.final)), idle_timeout)
    await write_stream(response, _sse("[DONE]"), idle_timeout)
    await response.write_eof()
    return response


async def _respond_once(
    request: web.Request, gen: Generation, builder: ResponseBuilder
) -> web.Response:
    last = await gen.first()
    async for output in gen.rest():
        last = output
    failure = request_failure(gen, request.app[STATE])
    if failure is not None:
        raise failure
    return json_response(builder.full_response(last))


async def prompt_ids_of(
    state: ServerState, engine: EngineClient, parsed: ParsedRequest, tenant: str
) -> list[int]:
    """The parsed request's prompt ids (its chat template rendered off the event loop), once
    its model is checked; a refusal is counted as an invalid request of its lane and tenant."""
    state.check_model(parsed.model)
    try:
        return await asyncio.to_thread(
            encode_prompt, engine.tokenizer, parsed, engine.vocab_size, engine.max_model_len
        )
    except APIError:
        state.metrics.rejected(RejectReason.INVALID, parsed.lane, tenant)
        raise


async def _serve(request: web.Request, kind: Endpoint) -> web.StreamResponse:
    state = request.app[STATE]
    engine = state.ready_engine()
    raw = await read_body(request)
    try:
        body = decode_request(
            raw, CompletionRequest if kind is Endpoint.COMPLETION else ChatRequest
        )
        tenant = request_tenant(request.headers.get("X-Tenant"), body.user)
        parse = parse_completion if isinstance(body, CompletionRequest) else parse_chat
        parsed = parse(body, state.policy)  # type: ignore[arg-type]
    except APIError:
        state.metrics.request_rejected.labels(RejectReason.INVALID).inc()
        raise
    prompt_ids = await prompt_ids_of(state, engine, parsed, tenant)
    prefix = "cmpl" if kind is Endpoint.COMPLETION else "chatcmpl"
    # The engine's id is always fresh (a caller's id may repeat); the response's is the caller's.
    request_id = f"{prefix}-{uuid.uuid4().hex}"
    caller_id = _caller_id(request.headers.get("X-Request-Id"), body.request_id)
    response_id = request_id if caller_id is None else f"{prefix}-{caller_id}"
    if state.settings.enable_log_requests:
        logger.info(
            "request %s (%s): %d prompt tokens, lane %s, tenant %s, %s", request_id, response_id,
            len(prompt_ids), parsed.lane, tenant, parsed.params,
        )  # fmt: skip
    builder = ResponseBuilder(
        kind, response_id, state.model_name, engine.tokenizer, parsed.top_logprobs, parsed.tools,
        _echo_text(parsed, engine, prompt_ids), parsed.tokens_as_ids, parsed.token_ids,
    )  # fmt: skip
    gen = Generation(engine, parsed, prompt_ids, request_id, state.metrics, tenant)
    async with tracked(state, gen):
        if parsed.stream:
            return await _stream(request, gen, builder, parsed.usage)
        return await _respond_once(request, gen, builder)


def _caller_id(header: str | None, body_id: str | None) -> str | None:
    """The caller's id for the response, as vLLM picks it: an X-Request-Id header (held to
    the body's request_id rules, RequestIdText), else the body's request_id; None if neither
    is sent."""
    if not header:
        return body_id
    try:
        return msgspec.convert(header, RequestIdText)
    except msgspec.ValidationError as exc:
        raise APIError(400, f"X-Request-Id: {exc}", param="X-Request-Id") from None


def _echo_text(parsed: ParsedRequest, engine: EngineClient, prompt_ids: list[int]) -> str | None:
    """The prompt as `echo` puts it before the output (completions), or None without echo:
    the prompt as sent, or, with truncate_prompt_tokens, the ids served, decoded."""
    if not parsed.echo:
        return None
    if isinstance(parsed.prompt, str) and parsed.params.truncate_prompt_tokens is None:
        return parsed.prompt
    return engine.tokenizer.decode(prompt_ids, skip_special_tokens=False)


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.COMPLETION)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, Endpoint.CHAT)
