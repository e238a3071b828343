"""Hypothesis fuzzing of request bodies against the mock engine: no body may get a 5xx.

Every field a request Struct declares (server/protocol_types.py), plus an unknown one, is drawn
from its declared type (messages, tools, tool_choice, output constraints: valid shapes), with
arbitrary JSON in place of any part at times (wrong types, nesting), arbitrary Unicode with
lone surrogates, huge integers and the numbers JSON has no float for (NaN, Infinity, 1e400);
the body's bytes are written by hand. Each answer must be a 2xx with a well-formed body
(strict JSON, or an SSE stream without error events) or a 4xx with an OpenAI error body whose
message is at most 512 characters; afterwards a greedy request gives the same text as before
and nothing is left running. Fast (the mock answers in milliseconds): it runs in the normal
suite at the hypothesis profile's budget (tests/budgets.py).
"""

from __future__ import annotations

import asyncio
import json

import msgspec.inspect as mi
import pytest
from hypothesis import given
from hypothesis import strategies as st
from server_harness import parse_sse, serve

from jserve.server.mock_engine import MockEngine
from jserve.server.protocol_types import (
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

PROBE = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
ENDPOINTS = {
    "/v1/completions": (CompletionRequest, {"prompt": "ab", "max_tokens": 3}),
    "/v1/chat/completions": (
        ChatRequest, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}
    ),
    "/tokenize": (TokenizeRequest, {"prompt": "ab"}),
    "/detokenize": (DetokenizeRequest, {"tokens": [97, 98]}),
}  # fmt: skip


class Raw(str):
    """A JSON literal written as is: numbers Python's json cannot write (1e400) or that JSON
    has not (NaN)."""


def to_json(value: object) -> str:
    if isinstance(value, Raw):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(to_json, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{to_json(k)}: {to_json(v)}" for k, v in value.items()) + "}"
    return json.dumps(value)  # a str's lone surrogates become \udxxx escapes


LITERALS = st.sampled_from(["NaN", "Infinity", "-Infinity", "1e400", "-1e999", "1e-400"]).map(Raw)
SURROGATES = st.characters(categories=["Cs"])
TEXT = st.one_of(st.text(max_size=10), st.text(st.one_of(st.characters(), SURROGATES), max_size=10))
INTS = st.one_of(
    st.integers(-3, 70),
    st.sampled_from([2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, 10**30, 0x10FFFF, 0x110000]),
    st.integers(),
)
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False), LITERALS)
SCALARS = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
JSON = st.recursive(
    SCALARS,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(TEXT, inner, max_size=3)),
    max_leaves=6,
)


def typed(info: mi.Type, wild: bool) -> st.SearchStrategy:
    """Values of a declared msgspec type. `wild`: at each level, now and then any JSON
    instead, and scalars past their ranges; else values that mostly pass, so the fuzz
    reaches the engine and the response writers too."""
    well = _well_typed(info, wild)
    nested = isinstance(info, mi.StructType | mi.ListType | mi.UnionType)
    return st.one_of(well, JSON) if wild and nested else well


def _well_typed(info: mi.Type, wild: bool) -> st.SearchStrategy:
    if isinstance(info, mi.UnionType):
        return st.one_of([typed(t, wild) for t in info.types])
    if isinstance(info, mi.StructType):
        fields = {f.encode_name: typed(f.type, wild) for f in info.fields}
        required = {f.encode_name: fields.pop(f.encode_name) for f in info.fields if f.required}
        if info.tag_field is not None:
            required[info.tag_field] = st.just(info.tag)
        return st.fixed_dictionaries(required, optional=fields)
    if isinstance(info, mi.ListType):
        return st.lists(typed(info.item_type, wild), min_size=info.min_length or 0, max_size=3)
    if isinstance(info, mi.LiteralType | mi.EnumType):
        values = info.values if isinstance(info, mi.LiteralType) else [m.value for m in info.cls]
        return st.one_of(st.sampled_from(values), TEXT) if wild else st.sampled_from(values)
    if isinstance(info, mi.StrType) and info.pattern is not None:
        valid = st.from_regex(info.pattern, fullmatch=True)
        return st.one_of(valid, TEXT) if wild else valid
    clean, odd = {
        mi.NoneType: (st.none(), st.none()),
        mi.BoolType: (st.booleans(), st.booleans()),
        mi.IntType: (st.integers(0, 8), INTS),
        mi.FloatType: (st.floats(0.01, 1.5), FLOATS),
        mi.StrType: (st.text(max_size=10), TEXT),
        mi.AnyType: (st.none(), JSON),
        mi.DictType: (st.just({"type": "object"}), JSON),
    }[type(info)]
    return st.one_of(clean, odd) if wild else clean


FIELDS = {
    (kind, wild): {
        **{f.encode_name: typed(f.type, wild) for f in mi.type_info(kind).fields},
        "unknown_field": JSON,
    }
    for kind, _ in ENDPOINTS.values()
    for wild in (False, True)
}


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw body) of one adversarial request."""
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    kind, base = ENDPOINTS[path]
    shape = draw(st.sampled_from(["fields"] * 8 + ["not an object", "not JSON"]))
    if shape == "not an object":
        return path, to_json(draw(JSON)).encode()
    if shape == "not JSON":
        return path, draw(st.binary(max_size=20))
    fields = FIELDS[kind, draw(st.booleans())]
    body = dict(base)
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        body[name] = draw(fields[name])
    if draw(st.integers(0, 9)) == 0:
        body.pop(next(iter(base)))  # the required field, at times
    return path, to_json(body).encode()


def _strict_json(text: str) -> object:
    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a response body")

    return json.loads(text, parse_constant=refuse)


async def _check_answer(client, path: str, raw: bytes) -> None:
    response = await client.post(path, data=raw, headers={"Content-Type": "application/json"})
    text = await response.text()
    assert response.status < 500, (response.status, text[:500])
    if response.status < 300 and response.content_type == "text/event-stream":
        events = parse_sse(text)
        assert all("error" not in event for event in events[:-1]), text[-500:]
        return
    payload = _strict_json(text)
    if response.status < 300:
        assert "error" not in payload, payload
        return
    error = payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 512, error
    assert error["type"].endswith("_error") and isinstance(error["param"], str | None), error


async def _probe(client) -> str:
    response = await client.post("/v1/completions", json=PROBE)
    return (await response.json())["choices"][0]["text"]


@pytest.fixture(scope="module")
def mock_server():
    """(loop, client, engine): the app on the mock, on a loop of its own so hypothesis' sync
    test body can drive it."""
    loop = asyncio.new_event_loop()
    engine = MockEngine(token_delay=0, max_model_len=512, max_n=4)
    context = serve(engine)
    client = loop.run_until_complete(context.__aenter__())
    yield loop, client, engine
    loop.run_until_complete(context.__aexit__(None, None, None))
    loop.close()


def test_fuzzed_bodies_never_get_a_5xx_and_the_server_still_serves(mock_server):
    loop, client, engine = mock_server
    before = loop.run_until_complete(_probe(client))
    assert before == PROBE["prompt"][:8]

    @given(case=requests())
    def one_request(case: tuple[str, bytes]) -> None:
        loop.run_until_complete(asyncio.wait_for(_check_answer(client, *case), 30))

    one_request()
    assert loop.run_until_complete(_probe(client)) == before
    stats = engine.stats()
    assert (stats.num_requests_running, stats.num_requests_waiting) == (0, 0)
