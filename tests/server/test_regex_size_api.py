"""A regex whose counted repetitions unroll past jserve.config.regex_size.MAX_REGEX_SIZE is a 400
naming the field, from every place a regex reaches the grammar engine, and the request never
reaches the engine (so nothing is compiled); realistic regexes still are served."""

from __future__ import annotations

import pytest
from server_harness import serve

from jserve.server.mock_engine import MockEngine

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
HI = [{"role": "user", "content": "Hi"}]
BOMB = "a{1000000}"


def _json_schema(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


def _tool(parameters: dict, name: str = "f") -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


REQUIRED = {"messages": HI, "tool_choice": "required"}
BOMBS = [
    (COMPLETIONS, {"structured_outputs": {"regex": BOMB}}, "structured_outputs"),
    (COMPLETIONS, {"guided_regex": "(a{1000}){1000}"}, "guided_regex"),
    (COMPLETIONS, {"guided_regex": "(a{100}){100}{100}"}, "guided_regex"),
    (CHAT, {"messages": HI, "response_format": _json_schema({"type": "string", "pattern": BOMB})},
     "response_format"),
    (COMPLETIONS, {"guided_json": {"patternProperties": {BOMB: {}}}}, "guided_json"),
    (COMPLETIONS, {"guided_json": {"$defs": {"k": {"propertyNames": {"pattern": BOMB}}}}},
     "guided_json"),
    (COMPLETIONS, {"structured_outputs": {"json": {"items": {"pattern": BOMB}}}},
     "structured_outputs"),
    (COMPLETIONS, {"guided_grammar": f'start: "/" /{BOMB}/'}, "guided_grammar"),
    (COMPLETIONS, {"guided_grammar": 'start: A\nA: B{1000}\nB: "a"{1000}'}, "guided_grammar"),
    (CHAT, {**REQUIRED, "tools": [_tool({"properties": {"c": {"pattern": BOMB}}})]},
     "tools[0].function.parameters"),
    (CHAT, {"messages": HI, "tools": [_tool({}), _tool({"patternProperties": {BOMB: {}}}, "g")],
            "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tools[1].function.parameters"),
]  # fmt: skip


class _NeverCalled(MockEngine):
    async def generate(self, *args, **kwargs):
        raise AssertionError("a refused constraint reached the engine")
        yield  # an async generator, like the engine's


async def test_each_place_a_regex_hides_is_a_400_before_the_engine():
    async with serve(_NeverCalled()) as client:
        for path, extra, param in BOMBS:
            body = {"prompt": "x", **extra} if path == COMPLETIONS else extra
            response = await client.post(path, json={"max_tokens": 4, **body})
            reply = await response.json()
            assert response.status == 400, reply
            error = reply["error"]
            assert error["param"] == param, (extra, error)
            assert "expands to about 1,000,000 nodes" in error["message"], error
            assert "use + or * or a smaller count" in error["message"], error


@pytest.mark.parametrize(
    "constraint",
    [
        {"guided_regex": r"\d{4}-\d{2}-\d{2}"},
        {"structured_outputs": {"regex": "[a-z]{1,64}"}},
        {"guided_regex": ".{0,1000}"},
        {"guided_json": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{5}$", "maxLength": 99999}},
        {"guided_grammar": 'start: "id-" /[0-9a-f]{8}/'},
        # a tool the named choice leaves out is not in its grammar
        {
            "messages": HI,
            "tools": [_tool({}), _tool({"patternProperties": {BOMB: {}}}, "g")],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        },
    ],
)
async def test_realistic_regexes_reach_the_engine(constraint):
    path, body = (CHAT, {}) if "messages" in constraint else (COMPLETIONS, {"prompt": "ok"})
    async with serve(MockEngine(max_model_len=4096)) as client:  # room for the tools' prompt
        response = await client.post(path, json={"max_tokens": 3, **body, **constraint})
        assert response.status == 200, await response.text()
