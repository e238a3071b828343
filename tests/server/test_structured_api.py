"""Structured outputs and tool calls over HTTP, on the real model in-process: response_format,
vLLM's structured_outputs / guided_* fields, tools with tool_choice (plain and streamed), and
the 400s for constraints that cannot be served."""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import AsyncIterator

import jsonschema
import msgspec
import pytest
from server_harness import serve, stream_events

from jserve.engine.async_engine import AsyncLLMEngine
from jserve.server.protocol import chat_messages, render_chat
from jserve.server.protocol_types import Message
from jserve.server.tools import ToolRequest

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextlib.asynccontextmanager
async def client_of(engine) -> AsyncIterator:
    aengine = AsyncLLMEngine(engine)
    try:
        async with serve(aengine) as client:
            yield client
    finally:
        await aengine.shutdown()


async def post(client, path: str, body: dict) -> tuple[int, dict]:
    response = await client.post(path, json={"temperature": 0, "max_tokens": 80, **body})
    return response.status, await response.json()


async def test_response_format_and_guided_fields_constrain_the_output(engine):
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    async with client_of(engine) as client:
        status, body = await post(
            client, CHAT, {"messages": [{"role": "user", "content": "A person?"}],
                           "response_format": person},
        )  # fmt: skip
        assert status == 200, body
        jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), PERSON)
        status, body = await post(
            client, COMPLETIONS, {"prompt": "My phone number is", "guided_regex": r" \d{3}-\d{4}"}
        )
        assert re.fullmatch(r" \d{3}-\d{4}", body["choices"][0]["text"]), body
        status, body = await post(
            client, COMPLETIONS,
            {"prompt": "Is fire hot? Answer:", "structured_outputs": {"choice": [" yes", " no"]}},
        )  # fmt: skip
        assert body["choices"][0]["text"] in (" yes", " no"), body
        status, body = await post(
            client, COMPLETIONS,
            {"prompt": "Colour:", "guided_choice": ["red", "blue"], "n": 2, "temperature": 1},
        )  # fmt: skip
        assert {c["text"] for c in body["choices"]} <= {"red", "blue"}, body


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}},
         "invalid JSON schema"),
        ({"guided_json": {"type": "array", "uniqueItems": True}}, "does not support"),
        ({"guided_regex": "(unclosed"}, "invalid regex"),
        ({"guided_grammar": "start: nowhere"}, "invalid grammar"),
        ({"guided_regex": "a{1000000}"}, "expands to about 1,000,000 nodes"),
        ({"guided_choice": [f"option {i}" for i in range(10_000)]}, "at most 1000 are served"),
    ],
)  # fmt: skip
async def test_constraints_that_cannot_be_served_are_400s(engine, body, words):
    async with client_of(engine) as client:
        status, reply = await post(client, COMPLETIONS, {"prompt": "x", **body})
    assert status == 400, reply
    assert words in reply["error"]["message"], reply
    assert len(reply["error"]["message"]) < 300 and "<state>" not in reply["error"]["message"]


def _arguments(call: dict, tool: dict) -> dict:
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == tool["function"]["name"]
    arguments = json.loads(call["function"]["arguments"])
    jsonschema.validate(arguments, tool["function"]["parameters"])
    return arguments


# The tools, as a new user writes them: no additionalProperties, no length limits.
def _open_tool(name: str, description: str, argument: str) -> dict:
    parameters = {
        "type": "object",
        "properties": {argument: {"type": "string"}},
        "required": [argument],
    }
    function = {"name": name, "description": description, "parameters": parameters}
    return {"type": "function", "function": function}


OPEN_WEATHER = _open_tool("get_weather", "Get the current weather in a city", "city")
OPEN_TIME = _open_tool("get_time", "The time in a time zone", "zone")
TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in London?"}]


@pytest.mark.parametrize(
    ("tools", "tool_choice", "parallel", "finish_reason", "cities"),
    [
        ([OPEN_WEATHER, OPEN_TIME], {"type": "function", "function": {"name": "get_weather"}},
         True, "stop", ["Paris"]),
        ([OPEN_WEATHER, OPEN_TIME], "required", False, "tool_calls", ["Paris"]),
        ([OPEN_WEATHER], "required", True, "tool_calls", ["Paris", "London"]),
    ],
)  # fmt: skip
async def test_forced_tool_calls_end_before_max_tokens_with_open_schemas(
    engine, tools, tool_choice, parallel, finish_reason, cities
):
    """SmolLM2 at temperature 0 looped until max_tokens on each of these (an open arguments
    object, free whitespace, unbounded calls); the grammar now ends after the calls."""
    request = {
        "messages": TWO_CITIES, "tools": tools, "tool_choice": tool_choice,
        "parallel_tool_calls": parallel, "max_tokens": 200,
    }  # fmt: skip
    async with client_of(engine) as client:
        status, body = await post(client, CHAT, request)
    assert status == 200, body
    choice = body["choices"][0]
    assert body["usage"]["completion_tokens"] < 200  # it ended by itself
    assert choice["finish_reason"] == finish_reason and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [_arguments(c, OPEN_WEATHER) for c in calls] == [{"city": city} for city in cities]


async def test_a_call_cut_by_max_tokens_is_dropped_and_the_completed_one_kept(engine):
    """The second call of two is cut: the first is returned, finish_reason is "length", and
    no markup reaches the content, streamed or not."""
    request = {
        "messages": TWO_CITIES, "tools": [OPEN_WEATHER], "tool_choice": "required",
        "max_tokens": 45,
    }  # fmt: skip
    async with client_of(engine) as client:
        _, whole = await post(client, CHAT, request)
        events = await stream_events(client, CHAT, {"temperature": 0, **request})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length" and whole["usage"]["completion_tokens"] == 45
    assert choice["message"]["content"] is None
    [call] = choice["message"]["tool_calls"]
    assert _arguments(call, OPEN_WEATHER) == {"city": "Paris"}
    chunks = [e for e in events if isinstance(e, dict)]
    assert "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks) == ""
    streamed = [c for e in chunks for c in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [c["function"] for c in streamed] == [call["function"]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_tools_reach_a_template_without_tool_support_through_the_system_message(engine):
    tools = ToolRequest([WEATHER], "auto")
    text = render_chat(engine.tokenizer, ASK, tools=tools)
    assert "<|im_start|>system\nYou may call one or more functions" in text
    assert json.dumps(WEATHER) in text and text.endswith("<|im_start|>assistant\n")
    history = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]  # fmt: skip
    messages = chat_messages(msgspec.convert(history, list[Message]))
    rendered = render_chat(engine.tokenizer, messages, tools=tools)
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        in rendered
    )
    assert "<|im_start|>tool\nsunny<|im_end|>" in rendered
