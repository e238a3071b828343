"""Admission and error behaviour: each bad input gets its status and an OpenAI error body, and
the server stays healthy afterwards."""

from __future__ import annotations

import asyncio
import json

import pytest
from server_harness import metric, parse_sse, serve, stream_events

from jserve.config.validation import INT32_MAX
from jserve.errors import RejectReason, RequestRejected
from jserve.server.api_errors import rejection_to_api_error
from jserve.server.mock_engine import MockEngine
from jserve.server.state import STATE, set_engine

HI = [{"role": "user", "content": "Hi"}]
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"

# (path, raw body or JSON, status, expected error param, a fragment of the message)
BAD_INPUTS = [
    (COMPLETIONS, b"{not json", 400, None, "not valid JSON"),
    (COMPLETIONS, b"[1, 2]", 400, None, "the request body is invalid: expected `object`"),
    (COMPLETIONS, b'{"prompt": "a", "timeout": NaN}', 400, "timeout", "must be a finite number"),
    (COMPLETIONS, b'{"prompt": "\xff"}', 400, None, "not valid JSON"),
    (COMPLETIONS, {"max_tokens": 3}, 400, "prompt", "'prompt' is required"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt", "must not be empty"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt", "non-empty"),
    (COMPLETIONS, {"prompt": [1, "a"]}, 400, "prompt", "token ids"),
    (COMPLETIONS, {"prompt": [-1]}, 400, "prompt",
     "prompt[0] must be a token id in [0, 1114112), got -1"),
    (COMPLETIONS, {"prompt": [5, 2**31]}, 400, "prompt",
     "prompt[1] must be a token id in [0, 1114112), got 2147483648"),
    (COMPLETIONS, {"prompt": ["a", "b"]}, 400, "prompt", "one prompt per request"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": "x"}, 400, "max_tokens",
     "'max_tokens' is invalid: expected `int | null`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    (COMPLETIONS, {"prompt": "a", "temperature": "hot"}, 400, "temperature",
     "expected `float | null`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "temperature": -1}, 400, "temperature",
     "temperature must be a finite number in [0, 3.40282e+38] (as float32), got -1.0"),
    # Defect 7: 1e400 parses as inf, 1e-300 rounds to 0 in float32.
    (COMPLETIONS, b'{"prompt": "a", "temperature": 1e400}', 400, "temperature",
     "'temperature' must be a finite number"),
    (COMPLETIONS, {"prompt": "a", "repetition_penalty": 1e-300}, 400, "repetition_penalty",
     "repetition_penalty must be a finite number in (0, 2] (as float32), got 1e-300"),
    (COMPLETIONS, {"prompt": "a", "top_p": 0}, 400, "top_p",
     "top_p must be a finite number in (0, 1] (as float32), got 0.0"),
    (COMPLETIONS, {"prompt": "a", "top_k": 2**31}, 400, "top_k",
     f"top_k must be an integer in [0, {INT32_MAX}], got 2147483648"),
    (COMPLETIONS, {"prompt": "a", "max_tokens": 2**31}, 400, "max_tokens",
     f"max_tokens must be an integer in [1, {INT32_MAX}], got 2147483648"),
    (COMPLETIONS, {"prompt": "a", "seed": 2**64}, 400, "seed", "seed must be an integer in"),
    # Defect 1: the stop id that overflowed the sampler's int32 array and killed the engine.
    (COMPLETIONS, {"prompt": "Hi", "max_tokens": 4, "min_tokens": 1,
                   "stop_token_ids": [2147483648]}, 400, "stop_token_ids[0]",
     f"stop_token_ids[0] must be an integer in [0, {INT32_MAX}], got 2147483648"),
    (COMPLETIONS, {"prompt": "Hi", "stop_token_ids": [3, 0x110000]}, 400, "stop_token_ids",
     "stop_token_ids[1] must be a token id in [0, 1114112), got 1114112"),
    # Deep nesting where a type stops it early, and in a free-form field (a JSON schema).
    (COMPLETIONS, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400,
     "prompt[0][0]", "expected `int`, got `array`"),
    (COMPLETIONS, b'{"prompt": "a", "guided_json": {"a": ' + b"[" * 100_000 + b"]" * 100_000
     + b"}}", 400, None, "not valid JSON: nested too deeply"),
    (COMPLETIONS, {"prompt": "a", "n": True}, 400, "n", "expected `int | null`, got `bool`"),
    (COMPLETIONS, {"prompt": "a", "n": 0}, 400, "n", f"n must be an integer in [1, {INT32_MAX}]"),
    # Refused by the engine (its --max-n), which names the field too.
    (COMPLETIONS, {"prompt": "a", "n": 65}, 400, "n", "n must be at most 64, got 65"),
    (COMPLETIONS, {"prompt": "a", "logprobs": 21}, 400, "logprobs", "logprobs must be"),
    (COMPLETIONS, {"prompt": "a", "stop": [1]}, 400, "stop[0]", "expected `str`, got `int`"),
    (COMPLETIONS, {"prompt": "a", "stop": [""]}, 400, "stop", "stop must be a non-empty"),
    (COMPLETIONS, {"prompt": "a", "stop": ["x"] * 129}, 400, "stop",
     "stop has 129 strings; at most 128"),
    (COMPLETIONS, {"prompt": "a", "stop_token_ids": ["x"]}, 400, "stop_token_ids[0]",
     "expected `int`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "presence_penalty": 3}, 400, "presence_penalty",
     "presence_penalty"),
    (COMPLETIONS, {"prompt": "a", "min_tokens": 5, "max_tokens": 2}, 400, "min_tokens",
     "min_tokens (5) must be <= max_tokens (2)"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "echo": True}, 400, "echo",
     "/v1/completions only"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "prompt_logprobs": 0}, 400,
     "prompt_logprobs", "/v1/completions only"),
    (COMPLETIONS, {"prompt": "a", "prompt_logprobs": 21}, 400, "prompt_logprobs",
     "prompt_logprobs must be"),
    (COMPLETIONS, {"prompt": "a", "logit_bias": {"x": 5}}, 400, "logit_bias",
     "logit_bias keys must be token ids (integers), got 'x'"),
    (COMPLETIONS, {"prompt": "a", "logit_bias": {"-3": 5}}, 400, "logit_bias",
     "logit_bias token id must be an integer in [0, "),
    (COMPLETIONS, {"prompt": "a", "logit_bias": {"1": "x"}}, 400, "logit_bias",
     "expected `float`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias", "at most 300 are served"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "logit_bias": {"1": 5}}, 400,
     "logit_bias", "'logit_bias' does not apply with use_beam_search"),
    (COMPLETIONS, {"prompt": "a", "best_of": 3}, 400, "best_of", "not supported"),
    # vLLM's extensions jserve does not honour: refused unless at vLLM's default.
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "stop": ["x"]}, 400, "stop",
     "'stop' does not apply with use_beam_search"),
    (CHAT, {"messages": HI, "use_beam_search": True, "logprobs": True}, 400, "logprobs",
     "'logprobs' does not apply with use_beam_search"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "logprobs": 0}, 400, "logprobs",
     "'logprobs' does not apply with use_beam_search"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "skip_special_tokens": False}, 400,
     "skip_special_tokens", "'skip_special_tokens' does not apply with use_beam_search"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "n": 11}, 400, "n",
     "n must be an integer in [1, 10], got 11"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "max_tokens": 10**6}, 400, "prompt",
     "1000001 tokens exceed max_model_len"),
    (COMPLETIONS, {"prompt": "a", "use_beam_search": True, "length_penalty": "x"}, 400,
     "length_penalty", "expected `float | null`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "allowed_token_ids": []}, 400, "allowed_token_ids",
     "allowed_token_ids must hold at least one token id"),
    (COMPLETIONS, {"prompt": "a", "allowed_token_ids": [-1]}, 400, "allowed_token_ids[0]",
     "allowed_token_ids[0] must be an integer"),
    (COMPLETIONS, {"prompt": "a", "bad_words": ["x", " "]}, 400, "bad_words",
     "bad_words must be a list of words (non-blank strings)"),
    (COMPLETIONS, {"prompt": "a", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens",
     "truncate_prompt_tokens must be -1 (the model's max_model_len) or an integer >= 1"),
    (CHAT, {"messages": [{"role": "user", "content": "a"}], "truncate_prompt_tokens": 10**6}, 400,
     "truncate_prompt_tokens", "must be at most max_model_len"),
    (COMPLETIONS, {"prompt": "a", "cache_salt": ""}, 400, "cache_salt",
     "'cache_salt' must be a non-empty string"),
    (COMPLETIONS, {"prompt": "a", "length_penalty": 0.5}, 400, "length_penalty",
     "'length_penalty' applies only with use_beam_search"),
    (CHAT, {"messages": HI, "continue_final_message": True, "add_generation_prompt": True}, 400,
     "continue_final_message", "cannot both be true"),
    (CHAT, {"messages": HI, "chat_template": "{{ messages }}"}, 400, "chat_template",
     "--trust-request-chat-template is not set"),
    (CHAT, {"messages": HI, "documents": [{"title": 1}]}, 400, "documents[0]",
     "expected `str`, got `int`"),
    (CHAT, {"messages": HI, "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs", "may not set ['messages']"),
    (COMPLETIONS, {"prompt": "a", "lane": "urgent"}, 400, "lane", "must be one of"),
    (COMPLETIONS, {"prompt": "a", "lane": 1}, 400, "lane", "expected `str | null`, got `int`"),
    (COMPLETIONS, {"prompt": "a", "priority": "batch"}, 400, "priority",
     "expected `int | null`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "priority": 5}, 400, "priority", "not supported"),
    (COMPLETIONS, {"prompt": "a", "timeout": 0}, 400, "timeout",
     "timeout must be a finite number in (0,"),
    (COMPLETIONS, {"prompt": "a", "stream_options": {}}, 400, "stream_options", "stream=true"),
    (COMPLETIONS, {"prompt": "x" * 300}, 400, "prompt", "max_model_len (256)"),
    (COMPLETIONS, {"prompt": "x" * 250, "max_tokens": 7}, 400, "prompt", "(250 tokens)"),
    (CHAT, {"max_tokens": 3}, 400, "messages", "'messages' is required"),
    (CHAT, {"messages": []}, 400, "messages", "expected `array` of length >= 1"),
    (CHAT, {"messages": [{"content": "hi"}]}, 400, "messages[0].role", "is required"),
    (CHAT, {"messages": [{"role": "user", "content": 5}]}, 400, "messages[0].content",
     "expected `str | array | null`, got `int`"),
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content[0]", "only text content parts are supported, got type 'image_url'"),
    (CHAT, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role",
     "must be one of ['system', 'developer', 'user', 'assistant', 'tool', 'function']"),
    (CHAT, {"messages": [{"role": "assistant", "tool_calls": [
        {"function": {"name": "f", "arguments": "{oops"}}]}]}, 400,
     "messages[0].tool_calls[0].function", "'arguments' must be JSON text"),
    (CHAT, {"messages": HI, "max_completion_tokens": 0}, 400, "max_completion_tokens",
     "max_tokens must be an integer in [1,"),
    (CHAT, {"messages": HI, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs=true"),
    (CHAT, {"messages": HI, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs must be an integer in [0, 20], got 21"),
    (CHAT, {"messages": HI, "logprobs": 1}, 400, "logprobs", "expected `bool | null`, got `int`"),
    (CHAT, {"messages": HI, "tools": [], "tool_choice": "auto"}, 400, "tools",
     "expected `array` of length >= 1"),
    (CHAT, {"messages": HI, "tool_choice": "required"}, 400, "tool_choice", "needs 'tools'"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400,
     "tool_choice.function.name", "'tool_choice' names 'g', which is not in 'tools'"),
    (CHAT, {"messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}],
     "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "tool_choice", "constrains the output itself"),
    (COMPLETIONS, {"prompt": "a", "tools": []}, 400, "tools", "only supported on /v1/chat"),
    (CHAT, {"messages": HI, "response_format": {"type": "xml"}}, 400, "response_format.type",
     "must be one of ['text', 'json_object', 'json_schema']"),
    (CHAT, {"messages": HI, "response_format": {"type": "json_schema"}}, 400,
     "response_format.json_schema", "'response_format.json_schema' is required"),
    (COMPLETIONS, {"prompt": "a", "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice", "give one output constraint"),
    (COMPLETIONS, {"prompt": "a", "structured_outputs": {"xml": "a"}}, 400,
     "structured_outputs", "has an unknown field 'xml'; its fields are ['json', 'json_object',"),
    (COMPLETIONS, {"prompt": "a", "guided_choice": "a"}, 400, "guided_choice",
     "expected `array | null`, got `str`"),
    (COMPLETIONS, {"prompt": "a", "guided_choice": []}, 400, "guided_choice",
     "non-empty list of non-empty strings"),
    ("/tokenize", {"text": "a"}, 400, "prompt", "send 'prompt'"),
    ("/detokenize", {"tokens": [1, -2]}, 400, "tokens",
     "tokens[1] must be a token id in [0, 1114112), got -2"),
    # Defect 5 (a 500 before) and defect 7 (a 200 with empty text before).
    ("/detokenize", {"tokens": [2**70]}, 400, "tokens",
     "tokens[0] must be a token id in [0, 1114112), got 1180591620717411303424"),
    ("/detokenize", {"tokens": [0x110000]}, 400, "tokens", "tokens[0] must be a token id"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens", "expected `array`, got `str`"),
    ("/tokenize", {"prompt": 5}, 400, "prompt", "expected `str | null`, got `int`"),
    ("/tokenize", {"messages": [{"role": "user"}], "add_generation_prompt": "yes"}, 400,
     "add_generation_prompt", "expected `bool | null`, got `str`"),
]  # fmt: skip


def _check_error_body(body: dict, status: int) -> dict:
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == {400: "invalid_request_error", 401: "authentication_error",
                             404: "not_found_error", 413: "invalid_request_error",
                             429: "rate_limit_error", 500: "server_error",
                             503: "service_unavailable"}[status]  # fmt: skip
    return error


async def test_bad_inputs_table_then_still_healthy():
    async with serve(MockEngine(token_delay=0.001)) as client:
        for path, body, status, param, fragment in BAD_INPUTS:
            kwargs = {"data": body} if isinstance(body, bytes) else {"json": body}
            response = await client.post(path, **kwargs)
            assert response.status == status, (path, body, await response.text())
            error = _check_error_body(await response.json(), status)
            assert fragment in error["message"], (body, error)
            assert error["param"] == param, (body, error)
        assert (await client.get("/health")).status == 200
        ok = await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 3})
        assert (await ok.json())["choices"][0]["text"] == "oko"
        metrics = await (await client.get("/metrics")).text()
    # The engine refused the two prompt-too-long rows and the beam search (which refuses as
    # it would); the server refused the rest itself.
    assert metric(metrics, "jserve:request_rejected_total", 'reason="too_long"') == 3


async def test_prompt_too_long_error_code():
    async with serve(MockEngine()) as client:
        response = await client.post(COMPLETIONS, json={"prompt": "x" * 300})
        error = (await response.json())["error"]
    assert error["code"] == "context_length_exceeded"
    assert "300 tokens" in error["message"]


async def test_api_key_guards_everything_but_health_and_metrics():
    async with serve(MockEngine(token_delay=0.001), api_key="sekret") as client:
        body = {"prompt": "ab", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekret"}):
            response = await client.post(COMPLETIONS, json=body, headers=headers)
            assert response.status == 401
            assert _check_error_body(await response.json(), 401)["code"] == "invalid_api_key"
        assert (await client.get("/v1/models")).status == 401
        good = await client.post(COMPLETIONS, json=body, headers={"Authorization": "Bearer sekret"})
        assert good.status == 200
        assert (await client.get("/health")).status == 200
        assert (await client.get("/metrics")).status == 200


async def test_unknown_model_route_and_method_are_json_errors():
    async with serve(MockEngine()) as client:
        model = await client.post(COMPLETIONS, json={"model": "gpt-4", "prompt": "a"})
        route = await client.get("/v1/nothing-here")
        method = await client.get(COMPLETIONS)
        assert (model.status, route.status, method.status) == (404, 404, 405)
        error = _check_error_body(await model.json(), 404)
        assert (error["code"], error["param"]) == ("model_not_found", "model")
        assert "gpt-4" in error["message"] and "mock-model" in error["message"]
        assert "/v1/nothing-here" in _check_error_body(await route.json(), 404)["message"]
        assert (await method.json())["error"]["message"]


async def test_body_over_the_limit_is_413():
    async with serve(MockEngine(), max_body_bytes=1000) as client:
        response = await client.post(COMPLETIONS, json={"prompt": "x" * 2000})
        assert response.status == 413
        assert "1000 bytes" in _check_error_body(await response.json(), 413)["message"]
        assert (await client.get("/health")).status == 200


async def _wait_for(predicate, timeout: float = 2.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


async def test_full_queue_is_429_with_retry_after():
    engine = MockEngine(token_delay=0.01, max_num_seqs=1, max_waiting=1)
    body = {"prompt": "abc", "max_tokens": 100}
    async with serve(engine) as client:
        running = asyncio.create_task(client.post(COMPLETIONS, json=body))
        await _wait_for(lambda: engine.stats().num_requests_running == 1)
        waiting = asyncio.create_task(client.post(COMPLETIONS, json=body))
        await _wait_for(lambda: engine.stats().num_requests_waiting == 1)
        refused = await client.post(COMPLETIONS, json=body)
        assert refused.status == 429
        assert refused.headers["Retry-After"] == "1"
        assert _check_error_body(await refused.json(), 429)["code"] == "queue_full"
        metrics = await (await client.get("/metrics")).text()
        assert metric(metrics, "jserve:request_rejected_total", 'reason="queue_full"') == 1
        for task in (running, waiting):
            task.cancel()
        await asyncio.gather(running, waiting, return_exceptions=True)


async def test_503_while_starting_then_ready():
    async with serve(None) as client:
        health = await client.get("/health")
        assert (health.status, await health.json()) == (503, {"status": "starting"})
        refused = await client.post(COMPLETIONS, json={"prompt": "a"})
        assert refused.status == 503
        assert _check_error_body(await refused.json(), 503)["code"] == "starting"
        assert (await client.get("/metrics")).status == 200
        set_engine(client.app, MockEngine(token_delay=0.001))
        health = await client.get("/health")
        assert (health.status, await health.json()) == (200, {"status": "ready"})
        assert (await client.post(COMPLETIONS, json={"prompt": "a"})).status == 200


async def test_503_after_the_engine_died_and_mid_stream_error_event():
    engine = MockEngine(token_delay=0.01)
    async with serve(engine) as client:
        response = await client.post(
            COMPLETIONS, json={"prompt": "abc", "max_tokens": 100, "stream": True}
        )
        await response.content.readuntil(b"\n\n")  # first chunk arrived
        engine.kill("step loop crashed: out of memory")
        rest = (await response.content.read()).decode()
        assert '"error"' in rest and "out of memory" in rest
        assert rest.endswith("data: [DONE]\n\n")
        health = await client.get("/health")
        assert health.status == 503
        assert await health.json() == {"status": "dead: step loop crashed: out of memory"}
        refused = await client.post(COMPLETIONS, json={"prompt": "a"})
        assert refused.status == 503
        error = _check_error_body(await refused.json(), 503)
        assert error["code"] == "engine_dead" and "out of memory" in error["message"]


async def test_503_while_draining():
    async with serve(MockEngine()) as client:
        client.app[STATE].draining = True
        refused = await client.post(COMPLETIONS, json={"prompt": "a"})
        assert refused.status == 503
        assert _check_error_body(await refused.json(), 503)["code"] == "shutting_down"
        health = await client.get("/health")
        assert (health.status, await health.json()) == (503, {"status": "draining"})


class _BrokenEngine(MockEngine):
    def __init__(self, error: Exception) -> None:
        super().__init__()
        self.error = error

    async def generate(self, prompt, params, request_id, *, lane="interactive", timeout=None, **_):
        raise self.error
        yield  # an async generator, like the real one


@pytest.mark.parametrize(
    ("error", "status", "code"),
    [
        (RuntimeError("kaboom"), 500, "internal_error"),
        (RequestRejected("shutting_down", "engine is stopping"), 503, "shutting_down"),
        (RequestRejected("invalid", "token id 999999 is outside the vocabulary"), 400, "invalid"),
    ],
)
async def test_engine_exceptions_map_to_statuses(error, status, code):
    async with serve(_BrokenEngine(error)) as client:
        response = await client.post(COMPLETIONS, json={"prompt": "a", "stream": True})
        assert response.status == status
        assert _check_error_body(await response.json(), status)["code"] == code
        assert (await client.get("/health")).status == 200


_REJECTION_STATUS = {
    RejectReason.TOO_LONG: (400, "context_length_exceeded"),
    RejectReason.INVALID: (400, "invalid"),
    RejectReason.QUEUE_FULL: (429, "queue_full"),
    RejectReason.DEADLINE: (429, "deadline_unmeetable"),
    RejectReason.KV_FULL: (503, "kv_cache_full"),
    RejectReason.SHUTTING_DOWN: (503, "shutting_down"),
}


def test_every_rejection_reason_has_its_status_and_a_plain_string_code():
    assert set(_REJECTION_STATUS) == set(RejectReason)
    for reason, (status, code) in _REJECTION_STATUS.items():
        error = rejection_to_api_error(RequestRejected(reason, "no"))
        body = json.loads(error.response().body)["error"]
        assert (error.status, body["code"], body["message"]) == (status, code, "no")


class _FailsAfterOneToken(MockEngine):
    async def generate(self, prompt, params, request_id, *, lane="interactive", timeout=None, **_):
        async for output in super().generate(prompt, params, request_id):
            yield output
            raise RuntimeError("bug after the first token")


async def test_unexpected_error_mid_stream_ends_the_stream_cleanly():
    engine = _FailsAfterOneToken(token_delay=0.001)
    async with serve(engine) as client:
        response = await client.post(
            COMPLETIONS, json={"prompt": "abc", "max_tokens": 50, "stream": True}
        )
        events = parse_sse(await response.text())
        assert events[0]["choices"][0]["text"] == "a"
        assert events[1]["error"]["type"] == "server_error"
        assert (await client.get("/health")).status == 200
        assert engine.stats().num_requests_running == 0  # the server aborted it


async def test_health_and_metrics_report_engine_restarts():
    engine = MockEngine()
    async with serve(engine) as client:
        health = await client.get("/health")
        assert (health.status, await health.json()) == (200, {"status": "ready"})
        engine.num_restarts = engine._stats.num_restarts = 2
        health = await client.get("/health")
        assert (health.status, await health.json()) == (
            200,
            {"status": "ready", "engine_restarts": 2},
        )
        metrics = await (await client.get("/metrics")).text()
    assert metric(metrics, "jserve:engine_restarts_total") == 2


class _FailsItsRequest(MockEngine):
    """The engine fails the request after one token (as LLMEngine does when the request's own
    host-side work raises, or when a failed step restarts the engine)."""

    async def generate(self, prompt, params, request_id, *, lane="interactive", timeout=None, **_):
        async for output in super().generate(prompt, params, request_id):
            if output.finished:
                return
            yield output
            await self.abort(request_id)
            output.error = "OverflowError: Python int too large to convert to C long"
            for choice in output.outputs:
                choice.finish_reason = "error"
            output.finished = True
            yield output
            return


async def test_a_request_the_engine_failed_is_a_500_or_an_error_event():
    engine = _FailsItsRequest(token_delay=0.001)
    body = {"prompt": "abc", "max_tokens": 50}
    async with serve(engine) as client:
        once = await client.post(COMPLETIONS, json=body)
        assert once.status == 500
        error = _check_error_body(await once.json(), 500)
        assert error["code"] == "request_failed"
        assert error["message"] == (
            "the request failed: OverflowError: Python int too large to convert to C long"
        )
        events = await stream_events(client, COMPLETIONS, body)
        assert events[0]["choices"][0]["text"] == "a"
        assert events[-2]["error"]["code"] == "request_failed" and events[-1] == "[DONE]"
        assert (await client.get("/health")).status == 200


async def test_stop_lists_past_the_caps_get_400_and_at_the_caps_work():
    """Issue case 5: 10,000 stop strings of 380 characters (3.8 MB of JSON) stalled everyone
    else's requests; SamplingParams' caps refuse such lists, naming `stop`."""
    refused = [
        (["y" * 380] * 10_000, "stop has 10000 strings; at most 128 are allowed"),
        (["z" * 513], "stop strings must be at most 512 characters long"),
        (["w" * 512] * 4 + ["v"], "stop strings must be at most 2048 characters long in all"),
    ]
    at_caps = [f"{i:03d}" + "x" * 9 for i in range(127)] + ["cd"]  # 128 strings: the count cap
    async with serve(MockEngine(token_delay=0.001)) as client:
        for stop, message in refused:
            for path, body in [(COMPLETIONS, {"prompt": "a"}), (CHAT, {"messages": HI})]:
                response = await client.post(path, json={**body, "stop": stop})
                assert response.status == 400, await response.text()
                assert message in _check_error_body(await response.json(), 400)["message"]
        response = await client.post(
            COMPLETIONS, json={"prompt": "abcdef", "max_tokens": 6, "stop": at_caps}
        )
        choice = (await response.json())["choices"][0]
        assert (choice["text"], choice["stop_reason"]) == ("ab", "cd")
        assert (await client.get("/health")).status == 200
