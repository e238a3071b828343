"""OpenAI's Responses API, /v1/models/{id} and /ping, driven by the official `openai` client
against the mock engine: the text is the chat path's for the same messages, events come in
OpenAI's order, function calls and their outputs round-trip, previous_response_id continues
the conversation, and bad input is a 400 naming the field."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator

import openai
import pytest
from server_harness import chat_prompt, echo_text, serve

from jserve.server.decoding import decode_request
from jserve.server.mock_engine import MockEngine
from jserve.server.protocol import parse_chat
from jserve.server.response_store import ResponseStore, StoredResponse
from jserve.server.responses_api import chat_request
from jserve.server.responses_api_types import ResponsesRequest

MODEL = "mock-model"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}
TEXT_EVENTS = [
    "response.created", "response.in_progress", "response.output_item.added",
    "response.content_part.added", "response.output_text.delta", "response.output_text.done",
    "response.content_part.done", "response.output_item.done",
]  # fmt: skip


@contextlib.asynccontextmanager
async def _clients(engine: MockEngine, **settings) -> AsyncIterator[tuple]:
    async with serve(engine, **settings) as http:
        base_url = str(http.make_url("/v1"))
        api_key = settings.get("api_key") or "unused"
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            yield oai, http


def _error(exc: openai.APIStatusError) -> dict:
    """The OpenAI error object of a refusal (the client keeps the whole body)."""
    return exc.body.get("error", exc.body)


def _collapsed(types: list[str]) -> list[str]:
    """Event types with runs of the same type written once."""
    return [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]


async def test_models_by_id_and_ping():
    async with _clients(MockEngine(), api_key="k") as (oai, http):
        card = await oai.models.retrieve(MODEL)
        listed = [m async for m in oai.models.list()]
        with pytest.raises(openai.NotFoundError) as caught:
            await oai.models.retrieve("gpt-4")
        ping = await http.get("/ping")  # open, as /health is: no API key needed
        ping_post = await http.post("/ping")
    assert card.id == MODEL and card.object == "model"
    assert listed[0].to_dict() == card.to_dict()
    error = _error(caught.value)
    assert (error["param"], error["code"]) == ("model", "model_not_found")
    assert ping.status == ping_post.status == 200
    async with serve(None) as http:  # the engine still loads: /ping says so, as /health does
        assert (await http.get("/ping")).status == (await http.get("/health")).status == 503


async def test_text_is_the_chat_paths_for_the_same_messages():
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]
    async with _clients(MockEngine(token_delay=0.001)) as (oai, _):
        response = await oai.responses.create(
            model=MODEL, instructions="Be brief", input="Hi", max_output_tokens=6,
            metadata={"k": "v"},
        )  # fmt: skip
        chat = await oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=6)
        stopped = await oai.responses.create(model=MODEL, input="Hi", extra_body={"stop": "Hi"})
    assert response.output_text == chat.choices[0].message.content
    assert response.output_text == echo_text(chat_prompt(messages), 6)
    assert response.id.startswith("resp_") and response.object == "response"
    assert (response.status, response.incomplete_details.reason) == (
        "incomplete", "max_output_tokens"
    )  # fmt: skip
    [message] = response.output
    assert (message.type, message.role, message.content[0].type) == (
        "message", "assistant", "output_text"
    )  # fmt: skip
    usage = response.usage
    assert usage.input_tokens == chat.usage.prompt_tokens == len(chat_prompt(messages))
    assert (usage.output_tokens, usage.total_tokens) == (6, usage.input_tokens + 6)
    assert (response.instructions, response.metadata, response.store) == (
        "Be brief", {"k": "v"}, True
    )  # fmt: skip
    # "user: Hi\nassistant:" echoed up to the stop string "Hi"
    assert (stopped.output_text, stopped.status, stopped.incomplete_details) == (
        "user: ", "completed", None
    )  # fmt: skip


async def test_stream_sends_openais_events_in_order():
    async with _clients(MockEngine(token_delay=0.001)) as (oai, _):
        once = await oai.responses.create(model=MODEL, input="Hello", extra_body={"stop": "llo"})
        stream = await oai.responses.create(
            model=MODEL, input="Hello", extra_body={"stop": "llo"}, stream=True
        )
        events = [event async for event in stream]
        async with oai.responses.stream(
            model=MODEL, input="Hello", extra_body={"stop": "llo"}
        ) as helper:  # the client's own accumulator checks the events fit together
            final = await helper.get_final_response()
    assert _collapsed([e.type for e in events]) == [*TEXT_EVENTS, "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert once.output_text == "user: He"
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    completed = events[-1].response
    assert deltas == completed.output_text == final.output_text == once.output_text
    assert events[0].response.status == "in_progress" and completed.status == "completed"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {completed.output[0].id}
    assert completed.usage.output_tokens == len("user: Hello")  # the stop string's tokens count


async def test_output_text_logprobs_are_the_chat_paths_streamed_or_not():
    """include ["message.output_text.logprobs"] with top_logprobs: the output_text part's
    logprobs are chat's logprobs.content for the same messages; streamed, the delta events'
    logprobs, then the done event's whole list, give the same entries."""
    messages = [{"role": "user", "content": "Hi"}]
    asked = dict(include=["message.output_text.logprobs"], top_logprobs=2)
    async with _clients(MockEngine(token_delay=0.001)) as (oai, _):
        response = await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=5, **asked)
        chat = await oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=5, logprobs=True, top_logprobs=2
        )
        stream = await oai.responses.create(
            model=MODEL, input="Hi", max_output_tokens=5, stream=True, **asked
        )
        events = [event async for event in stream]
        plain = await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
    expected = [entry.to_dict() for entry in chat.choices[0].logprobs.content]
    assert len(expected) == 5 and all(len(e["top_logprobs"]) == 2 for e in expected)
    part = response.output[0].content[0]
    assert [entry.to_dict() for entry in part.logprobs] == expected
    assert "".join(e["token"] for e in expected) == part.text
    assert response.top_logprobs == 2
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    streamed = [entry.to_dict() for d in deltas for entry in d.logprobs]
    (done,) = [e for e in events if e.type == "response.output_text.done"]
    assert streamed == [entry.to_dict() for entry in done.logprobs] == expected
    assert plain.output[0].content[0].logprobs == []  # not asked: none


async def test_function_calls_round_trip_through_previous_response_id():
    """The model calls a tool (the mock echoes a call block put first in the prompt); the
    call's output sent back continues the conversation exactly as the chat path would."""
    prefix = "system: "
    request = dict(model=MODEL, tools=[WEATHER], max_output_tokens=len(prefix + CALL))
    engine = MockEngine(token_delay=0.0005, max_model_len=4096)
    async with _clients(engine) as (oai, _):
        first = await oai.responses.create(**request, instructions=CALL, input="Weather?")
        events = [
            e async for e in await oai.responses.create(
                **request, instructions=CALL, input="Weather?", stream=True
            )
        ]  # fmt: skip
        [message, call] = first.output
        answer = [{"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}]
        second = await oai.responses.create(
            model=MODEL, tools=[WEATHER], input=answer, previous_response_id=first.id,
            max_output_tokens=5,
        )  # fmt: skip
        chat = await oai.chat.completions.create(
            model=MODEL, max_tokens=5,
            tools=[{"type": "function", "function": {k: v for k, v in WEATHER.items()
                                                     if k != "type"}}],
            messages=[
                {"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": prefix, "tool_calls": [{
                    "id": call.call_id, "type": "function",
                    "function": {"name": "get_weather", "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny"},
            ],
        )  # fmt: skip
    assert message.content[0].text == prefix == first.output_text
    assert (call.type, call.name, json.loads(call.arguments)) == (
        "function_call", "get_weather", {"city": "Paris"}
    )  # fmt: skip
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    types = _collapsed([e.type for e in events])
    assert types == [
        *TEXT_EVENTS, "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done",
        "response.incomplete",
    ]  # fmt: skip
    streamed_call = events[-1].response.output[1]
    assert (streamed_call.name, streamed_call.arguments) == (call.name, call.arguments)
    # instructions are not carried over; the rest of the conversation is, as chat writes it
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id


async def test_stored_responses_continue_read_and_delete():
    async with _clients(MockEngine(token_delay=0.001)) as (oai, _):
        first = await oai.responses.create(model=MODEL, input="Hi", max_output_tokens=5)
        second = await oai.responses.create(
            model=MODEL, input="More", previous_response_id=first.id, max_output_tokens=5
        )
        read = await oai.responses.retrieve(first.id)
        unstored = await oai.responses.create(
            model=MODEL, input="x", store=False, max_output_tokens=2
        )
        await oai.responses.delete(first.id)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(first.id)
        for gone in (first.id, unstored.id):
            with pytest.raises(openai.BadRequestError) as caught:
                await oai.responses.create(model=MODEL, input="y", previous_response_id=gone)
            assert _error(caught.value)["param"] == "previous_response_id"
    conversation = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "More"},
    ]
    assert second.output_text == echo_text(chat_prompt(conversation), 5)
    assert second.usage.input_tokens == len(chat_prompt(conversation))
    assert read.to_dict() == first.to_dict()


def test_store_keeps_the_most_recently_used():
    store = ResponseStore(capacity=2)
    for name in "abc":
        if name == "c":
            assert store.get("a") is not None  # a is used: b is now the oldest
        store.put(StoredResponse({"id": name}, ()))
    assert [name for name in "abc" if store.get(name) is not None] == ["a", "c"]
    assert len(store) == 2


def test_text_format_becomes_the_chat_paths_output_constraint():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for spec, expected in [
        ({"type": "json_schema", "name": "s", "schema": schema}, {"json": schema}),
        ({"type": "json_object"}, {"json_object": True}),
        ({"type": "text"}, None),
    ]:
        raw = json.dumps({"input": "x", "text": {"format": spec}}).encode()
        chat, _ = chat_request(decode_request(raw, ResponsesRequest), ())
        constraint = parse_chat(chat).params.structured_outputs
        got = None if constraint is None else {
            k: v for k, v in vars(constraint).items() if v not in (None, False)
        }  # fmt: skip
        assert got == expected, spec


BAD = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]},
     "input[0]"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0]"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": "x", "tools": [WEATHER, WEATHER]}, "tools[1].name"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "f"}},
     "tool_choice.name"),
    ({"input": "x", "tool_choice": "required"}, "tool_choice"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "s"}}}, "text.format"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "temperature": -1}, "temperature"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "reasoning": {"effort": "low"}}, "reasoning"),
    ({"input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "x", "top_logprobs": 2}, "top_logprobs"),  # without include's logprobs
    ({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 21},
     "top_logprobs"),
    ({"input": "x", "truncation": "auto"}, "truncation"),
    ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ({"input": "x", "previous_response_id": "resp_unknown"}, "previous_response_id"),
    ({"input": "x" * 300}, "input"),  # longer than the mock's max_model_len
]  # fmt: skip


@pytest.mark.parametrize(("body", "param"), BAD, ids=[param for _, param in BAD])
async def test_bad_input_is_a_400_naming_the_field(body, param):
    async with serve(MockEngine()) as http:
        response = await http.post("/v1/responses", json=body)
        error = (await response.json())["error"]
        health = await http.get("/health")
    assert (response.status, error["param"]) == (400, param), error
    assert error["type"] == "invalid_request_error" and error["message"]
    assert health.status == 200


async def test_unknown_model_is_a_404():
    async with serve(MockEngine()) as http:
        response = await http.post("/v1/responses", json={"model": "gpt-4", "input": "x"})
        error = (await response.json())["error"]
    assert (response.status, error["param"], error["code"]) == (404, "model", "model_not_found")


async def test_engine_death_mid_stream_ends_with_response_failed():
    engine = MockEngine(token_delay=0.01)
    async with serve(engine) as http:
        response = await http.post("/v1/responses", json={"input": "Hello", "stream": True})
        assert response.status == 200
        await response.content.readuntil(b"response.output_text.delta")
        engine.kill("boom")
        raw = (await response.read()).decode()
    last = json.loads(raw.strip().split("\n")[-1].removeprefix("data: "))
    assert last["type"] == "response.failed"
    assert last["response"]["status"] == "failed"
    assert "boom" in last["response"]["error"]["message"]
