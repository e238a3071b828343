"""The request protocol's refusals at the boundary: lone surrogates in any text (issue case 2),
tool and tool_choice shapes (case 3), bounded error bodies (case 7), non-finite numbers in and
out. Each refusal is a 400 naming the field's path, and the server serves normally afterwards."""

from __future__ import annotations

import json
import math

import pytest
from server_harness import chat_prompt, echo_text, parse_sse, serve

from jserve.outputs import Logprob
from jserve.server.api_errors import MAX_MESSAGE_CHARS, APIError
from jserve.server.mock_engine import MockEngine
from jserve.server.responses import dump_json

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
LONE = "\\ud800"  # a JSON escape of a lone UTF-16 surrogate (Python's json writes it as well)
TOOL = {"type": "function", "function": {"name": "f"}}
SCHEMA = {"type": "object", "properties": {"a": {"type": "string"}}}


async def _refusal(client, path: str, raw: bytes, headers: dict | None = None) -> dict:
    response = await client.post(path, data=raw, headers=headers or {})
    text = await response.text()
    assert response.status == 400, text
    assert len(text) < 2 * MAX_MESSAGE_CHARS, len(text)  # bounded, whatever the input
    error = json.loads(text)["error"]
    assert error["type"] == "invalid_request_error" and len(error["message"]) <= 512, error
    return error


async def _still_serves(client) -> None:
    response = await client.post(COMPLETIONS, json={"prompt": "ok", "max_tokens": 3})
    assert (await response.json())["choices"][0]["text"] == "oko"
    chat = await client.post(CHAT, json={"messages": HI, "max_tokens": 4})
    expected = echo_text(chat_prompt(HI), 4)
    assert (await chat.json())["choices"][0]["message"]["content"] == expected


def _with(body: str, lone: str = LONE) -> bytes:
    """`body` (JSON text) with each "@" replaced by a lone surrogate's escape."""
    return body.replace("@", lone).encode()


# (path, body with "@" where a lone surrogate goes, the param that names it)
SURROGATES = [
    (COMPLETIONS, '{"prompt": "a@b"}', "prompt"),
    (COMPLETIONS, '{"prompt": ["@"]}', "prompt[0]"),
    (COMPLETIONS, '{"prompt": "a", "stop": ["x", "@"]}', "stop[1]"),
    (COMPLETIONS, '{"prompt": "a", "stop": "@"}', "stop"),
    (COMPLETIONS, '{"prompt": "a", "user": "u@"}', "user"),
    (COMPLETIONS, '{"prompt": "a", "guided_regex": "@"}', "guided_regex"),
    (COMPLETIONS, '{"prompt": "a", "guided_choice": ["x", "@"]}', "guided_choice[1]"),
    (CHAT, '{"messages": [{"role": "user", "content": "@"}]}', "messages[0].content"),
    (CHAT, '{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": '
     '[{"type": "text", "text": "@"}]}]}', "messages[1].content[0].text"),
    (CHAT, '{"messages": [{"role": "@", "content": "a"}]}', "messages[0].role"),
    (CHAT, '{"messages": [{"role": "user", "content": "a", "name": "@"}]}', "messages[0].name"),
    (CHAT, '{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
     '"function": {"name": "f@"}}]}', "tools[0].function.name"),
    (CHAT, '{"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", '
     '"function": {"name": "f", "description": "d@"}}]}', "tools[0].function.description"),
    (CHAT, '{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": '
     '"json_schema", "json_schema": {"name": "n", "schema": {"type": "object", "properties": '
     '{"a": {"enum": ["x", "@"]}}}}}}', "response_format.json_schema.schema.properties.a.enum[1]"),
    (CHAT, '{"messages": [{"role": "user", "content": "a"}], "response_format": {"type": '
     '"json_schema", "json_schema": {"schema": {"properties": {"k@": {}}}}}}',
     "response_format.json_schema.schema.properties"),
    (COMPLETIONS, '{"prompt": "a", "unknown_field": "@"}', "unknown_field"),
    ("/tokenize", '{"prompt": "@"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "@"}]}', "messages[0].content"),
]  # fmt: skip


@pytest.mark.parametrize("lone", [LONE, "\\udfff", "\\udbff\\u0041"])
async def test_a_lone_surrogate_anywhere_is_a_400_naming_the_field(lone):
    async with serve(MockEngine(token_delay=0.001)) as client:
        for path, body, param in SURROGATES:
            error = await _refusal(client, path, _with(body, lone))
            assert error["param"] == param, (body, error)
            assert "lone UTF-16 surrogate" in error["message"], error
        # A surrogate pair is valid text: U+1F600.
        pair = await client.post(COMPLETIONS, data=b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}')
        assert (await pair.json())["choices"][0]["text"] == "\U0001f600\U0001f600"
        await _still_serves(client)


NUMBER_FIELDS = ["temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "timeout", "max_tokens", "n", "seed"]  # fmt: skip


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400", "-1e999"])
async def test_non_finite_numbers_are_400s_naming_the_field(literal):
    async with serve(MockEngine(token_delay=0.001)) as client:
        for field in NUMBER_FIELDS:
            raw = f'{{"prompt": "a", "{field}": {literal}}}'.encode()
            error = await _refusal(client, COMPLETIONS, raw)
            assert error["param"] == field, (raw, error)
            assert "must be a finite number" in error["message"], error
        nested = f'{{"prompt": "a", "guided_json": {{"type": "object", "maximum": {literal}}}}}'
        error = await _refusal(client, COMPLETIONS, nested.encode())
        assert error["param"] == "guided_json.maximum", error
        await _still_serves(client)


# (tools, tool_choice, the param named); a `...` tool_choice leaves the field out.
TOOL_SHAPES = [
    ([TOOL], {"function": "f"}, "tool_choice.function"),
    ([TOOL], {"function": {"name": "f"}}, "tool_choice.type"),
    ([TOOL], 5, "tool_choice"),
    ([TOOL], "sometimes", "tool_choice"),
    ([TOOL], {"type": "function", "function": {}}, "tool_choice.function.name"),
    ([TOOL], {"type": "function", "function": {"name": "g"}}, "tool_choice.function.name"),
    ([TOOL], {"type": "other", "function": {"name": "f"}}, "tool_choice.type"),
    (None, "required", "tool_choice"),
    ([TOOL, {"type": "function"}], ..., "tools[1].function"),
    ([TOOL, {"function": {"name": "g"}}], ..., "tools[1].type"),
    ([TOOL, {"type": "function", "function": {"name": 7}}], ..., "tools[1].function.name"),
    ([TOOL, {"type": "function", "function": {"name": ""}}], ..., "tools[1].function.name"),
    ([TOOL, {"type": "function", "function": {"name": "g" * 65}}], ..., "tools[1].function.name"),
    ([TOOL, {"type": "function", "function": {"name": "get weather"}}], ...,
     "tools[1].function.name"),
    ([TOOL, {"type": "function", "function": {"name": "café"}}], ..., "tools[1].function.name"),
    ([TOOL, TOOL], ..., "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "f", "parameters": [1]}}], ...,
     "tools[0].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], ...,
     "tools[0].function.parameters"),
    ("f", ..., "tools"),
    ([], "auto", "tools"),
]  # fmt: skip


async def test_tools_and_tool_choice_have_openais_shapes():
    # Room for the tool prompt (the mock's template has no tools: they go to a system message).
    async with serve(MockEngine(token_delay=0.001, max_model_len=2048)) as client:
        for tools, choice, param in TOOL_SHAPES:
            body = {"messages": HI, "max_tokens": 2, "tools": tools}
            if choice is not ...:
                body["tool_choice"] = choice
            error = await _refusal(client, CHAT, json.dumps(body).encode())
            assert error["param"] == param, (tools, choice, error)
        # Allowed: a null tool_choice (the default, auto), "none", a named function, a
        # 64-character name, and null parallel_tool_calls.
        longest = {"type": "function", "function": {"name": "a-Z_0" * 12 + "abcd"}}
        for choice in (None, "none", "auto", "required",
                       {"type": "function", "function": {"name": "f"}}):  # fmt: skip
            body = {"messages": HI, "max_tokens": 2, "tools": [TOOL, longest],
                    "tool_choice": choice, "parallel_tool_calls": None}  # fmt: skip
            response = await client.post(CHAT, json=body)
            assert response.status == 200, (choice, await response.text())
        await _still_serves(client)


async def test_earlier_tool_calls_are_written_into_the_prompt():
    history = [
        *HI,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": '{"x": [1, 2]}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]  # fmt: skip
    async with serve(MockEngine(token_delay=0.001)) as client:
        response = await client.post("/tokenize", json={"messages": history})
        tokens = (await response.json())["tokens"]
    call = '<tool_call>\n{"name": "f", "arguments": {"x": [1, 2]}}\n</tool_call>'
    rendered = [*HI, {"role": "assistant", "content": call}, {"role": "tool", "content": "3"}]
    assert "".join(map(chr, tokens)) == chat_prompt(rendered)


MEGABYTE = "x" * 1_000_000


async def test_error_bodies_stay_small_whatever_the_input_holds():
    async with serve(MockEngine(token_delay=0.001)) as client:
        bodies = [
            ({"prompt": "a", "user": MEGABYTE}, "user"),
            ({"prompt": "a", "user": "\x00" + MEGABYTE}, "user"),
            ({"prompt": "a", "lane": MEGABYTE}, "lane"),
            ({"prompt": "a", "stop": [MEGABYTE, 5]}, "stop[1]"),
            ({"prompt": "a", "structured_outputs": {MEGABYTE: 1}}, "structured_outputs"),
            ({"prompt": MEGABYTE}, "prompt"),  # the engine's refusal: too long
            ({"messages": [{"role": "user", "content": [{"type": MEGABYTE}]}]},
             "messages[0].content[0]"),
            ({"messages": HI, "tools": [TOOL], "tool_choice":
              {"type": "function", "function": {"name": MEGABYTE}}}, "tool_choice.function.name"),
        ]  # fmt: skip
        for body, param in bodies:
            path = CHAT if "messages" in body else COMPLETIONS
            error = await _refusal(client, path, json.dumps(body).encode())
            assert error["param"] == param, (param, error)
            assert "x" * 100 not in error["message"], error  # an excerpt at most
        raw = b'{"prompt": "a", "' + MEGABYTE.encode() + b'": NaN}'
        error = await _refusal(client, COMPLETIONS, raw)
        assert len(error["param"]) <= 512 and "must be a finite number" in error["message"]
        header = await _refusal(client, COMPLETIONS, b'{"prompt": "a"}', {"X-Tenant": "y" * 4000})
        assert header["param"] == "X-Tenant" and "y" * 100 not in header["message"]
        model = await client.post(COMPLETIONS, json={"prompt": "a", "model": MEGABYTE})
        assert model.status == 404 and len(await model.text()) < 2 * MAX_MESSAGE_CHARS
        await _still_serves(client)


def test_api_error_cuts_its_message_and_param_with_an_ellipsis():
    error = APIError(400, "m" * 600, param="p" * 600)
    assert error.message == "m" * 511 + "…" and error.param == "p" * 511 + "…"
    assert len(error.body()["error"]["message"]) == MAX_MESSAGE_CHARS
    assert APIError(400, "short", param="x").body()["error"]["message"] == "short"


def test_responses_refuse_non_finite_numbers():
    assert dump_json({"logprob": -0.5, "text": "é"}) == '{"logprob": -0.5, "text": "é"}'
    for value in (math.inf, -math.inf, math.nan):
        with pytest.raises(ValueError, match="not JSON compliant"):
            dump_json({"logprob": value})


class _InfiniteLogprobs(MockEngine):
    """Alternatives with a -inf logprob, as a grammar-masked token could have."""

    async def generate(self, prompt, params, request_id, **kwargs):
        async for output in super().generate(prompt, params, request_id, **kwargs):
            for choice in output.outputs:
                for alternatives in choice.logprobs or []:
                    alternatives[max(alternatives) + 1] = Logprob(-math.inf, "z")
            yield output


async def test_a_non_finite_logprob_never_reaches_a_body_as_infinity():
    body = {"prompt": "ab", "max_tokens": 2, "logprobs": 1}
    async with serve(_InfiniteLogprobs(token_delay=0.001)) as client:
        once = await client.post(COMPLETIONS, json=body)
        assert once.status == 500
        assert json.loads(await once.text())["error"]["type"] == "server_error"
        streamed = await client.post(COMPLETIONS, json={**body, "stream": True})
        events = parse_sse(await streamed.text())
        assert events[-2]["error"]["type"] == "server_error" and events[-1] == "[DONE]"
        plain = await client.post(COMPLETIONS, json={"prompt": "ab", "max_tokens": 2})
        assert (await plain.json())["choices"][0]["text"] == "ab"
