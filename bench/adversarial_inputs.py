"""The phases of bench.adversarial_phases that replay the inputs which killed or stalled jserve
in the second adversarial round: control messages, lone surrogates, tool_choice shapes, grammar
bombs, a stop-string flood, a storm of large schemas, huge inputs echoed into error bodies, and
tool calls as a new user sends them.

Each phase returns one outcome per request (bench.adversarial_client), and notes in its tally
what went wrong beyond the status: an error body whose message is longer than 512 characters
or is not JSON, a GET /admin/scheduler that is not strict JSON, or tool-call output with markup
in `content`, missing calls or the wrong finish reason. Such a finding makes the run fail
(`Tally.wrong`), like a 5xx does.
"""

from __future__ import annotations

import argparse
import asyncio
import json

from bench.adversarial_client import Client, Tally

MAX_ERROR_MESSAGE = 512
SURROGATE = '"a\\ud800b"'  # a JSON string holding a lone UTF-16 surrogate
CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather in a city", "parameters": CITY},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Local time in a city", "parameters": CITY},
    },
]
WEATHER = [{"role": "user", "content": "What is the weather in Paris and in London?"}]


async def _checked(client: Client, tally: Tally, path: str, body: dict | bytes) -> str:
    """Send; an error body must be JSON with a bounded message, else the tally notes it."""
    outcome, status, reply = await client.post_read(path, body)
    if status >= 400:
        message = reply.get("error", {}).get("message") if isinstance(reply, dict) else None
        if not isinstance(message, str) or len(message) > MAX_ERROR_MESSAGE:
            tally.wrong.append(f"{path} {status}: error body not bounded JSON")
    return outcome


async def control_plane(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    weights = json.dumps({"tenant_weights": {f"t{i}": 1 for i in range(5000)}})
    bodies = [
        b'{"free_block_watermark": ' + b"9" * 400 + b"}",
        b'{"max_num_seqs": ' + b"9" * 400 + b"}",
        b'{"target_itl_ms": 1e400}',
        b'{"long_lane_max_share": NaN}',
        b'{"kv_reject_watermark": Infinity}',
        b'{"max_num_seqs": "8"}',
        b'{"decision_log": 1}',
        b'{"tenant_weights": {"gold": 1e400}}',
        weights.encode(),
        b'{"' + b"k" * 100_000 + b'": 1}',
    ]
    outcomes = [await _checked(client, tally, "/admin/scheduler", body) for body in bodies]
    text = await client.get_text("/admin/scheduler")
    try:
        json.loads(text, parse_constant=_refuse_constant)
    except ValueError:
        tally.wrong.append("GET /admin/scheduler is not strict JSON")
    return outcomes


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")


def _with_surrogate(body: dict) -> bytes:
    """`body` as JSON with every "@S" string replaced by one holding a lone surrogate (which
    Python's json would refuse to write)."""
    return json.dumps(body).replace('"@S"', SURROGATE).encode()


async def lone_surrogates(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    hi = [{"role": "user", "content": "hi"}]
    schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"enum": ["@S"]}}}
    sends = [
        ("/v1/completions", {"prompt": "@S", "max_tokens": 4}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "stop": ["@S"]}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "user": "@S"}),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 4, "response_format": schema}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "@S"}]}),
        ("/v1/chat/completions", {"messages": [{"role": "@S", "content": "hi"}]}),
        ("/v1/chat/completions",
         {"messages": [{"role": "user", "content": [{"type": "text", "text": "@S"}]}]}),
        ("/v1/chat/completions",
         {"messages": hi, "tools": [{"type": "function", "function": {"name": "@S"}}]}),
        ("/v1/chat/completions", {"messages": hi, "tools": [
            {"type": "function", "function": {"name": "f", "description": "@S"}}]}),
        ("/tokenize", {"prompt": "@S"}),
        ("/tokenize", {"messages": [{"role": "user", "content": "@S"}]}),
    ]  # fmt: skip
    return [await _checked(client, tally, path, _with_surrogate(body)) for path, body in sends]


async def tool_choice_shapes(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    base = {"messages": WEATHER, "max_tokens": 8, "temperature": 0}
    bad = [
        {"tools": TOOLS, "tool_choice": {"function": "f"}},
        {"tools": TOOLS, "tool_choice": 5},
        {"tools": TOOLS, "tool_choice": "sometimes"},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"tools": [{"function": {"name": "f"}}]},
        {"tools": [{"type": "function", "function": {"name": ""}}]},
        {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        {"tools": [{"type": "function", "function": {"name": "f" * 65}}]},
        {"tools": [TOOLS[0], TOOLS[0]]},
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
        {"tool_choice": "required"},
    ]
    outcomes = [await _checked(client, tally, "/v1/chat/completions", {**base, **b}) for b in bad]
    null_choice = {**base, "tools": TOOLS, "tool_choice": None}  # OpenAI's null: the default
    outcomes.append(await _checked(client, tally, "/v1/chat/completions", null_choice))
    return outcomes


async def grammar_bombs(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    base = {"prompt": "Answer:", "max_tokens": 4}
    deep: dict = {"type": "string"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"a": deep}, "required": ["a"]}
    bombs = [
        {"structured_outputs": {"regex": "a{1000000}"}},
        {"guided_regex": "(a|b){500}(c|d){500}"},
        {"guided_choice": [f"option {i}" for i in range(10_000)]},
        {"structured_outputs": {"grammar": "start: " + " | ".join(f'"w{i}"' for i in range(3000))}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": deep}}},
        {"guided_json": {"enum": [f"value-{i}-" + "x" * 40 for i in range(5000)]}},
        {"guided_regex": "(" * 50_000},
    ]
    return [await _checked(client, tally, "/v1/completions", {**base, **b}) for b in bombs]


async def count_bombs(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    """Counted repetition that unrolls to millions of states, in every place a regex reaches
    llguidance: refused before any compile (jserve.config.regex_size), so the probe should not
    notice them."""
    base = {"prompt": "Answer:", "max_tokens": 4}
    patterned = {"type": "object", "properties": {"a": {"type": "string", "pattern": "a{1000000}"}}}
    tool = {"type": "function", "function": {"name": "f", "parameters": patterned}}
    bombs = [
        {"structured_outputs": {"regex": "a{1000000}"}},
        {"structured_outputs": {"regex": "(a{1000}){1000}"}},
        {"structured_outputs": {"regex": "(a{100}){100}{100}"}},
        {"structured_outputs": {"json": patterned}},
        {"structured_outputs": {"grammar": "start: /a{1000000}/"}},
    ]
    outcomes = [await _checked(client, tally, "/v1/completions", {**base, **b}) for b in bombs]
    forced = {
        "messages": [{"role": "user", "content": "Call f."}], "max_tokens": 4,
        "tools": [tool], "tool_choice": "required",
    }  # fmt: skip
    outcomes.append(await _checked(client, tally, "/v1/chat/completions", forced))
    return outcomes


async def stop_flood(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    """The 3.8 MB stop list with n=16 that stalled other tenants: refused (SamplingParams caps
    the list; the matching cost at the caps is tests/core/test_stopping.py's)."""
    flood = {"prompt": "Tell a story:", "max_tokens": 32, "n": 16, "temperature": 1.0,
             "stop": [f"{i:05d}" + "z" * 375 for i in range(10_000)]}  # fmt: skip
    return [await _checked(client, tally, "/v1/completions", flood)]


def _schema(i: int) -> dict:
    """A large object schema, distinct per i (no cache hits), with bounded fields."""
    fields = {f"field_{i}_{k}": {"type": "string", "maxLength": 8} for k in range(60)}
    return {"type": "object", "properties": fields, "required": list(fields)[:2],
            "additionalProperties": False}  # fmt: skip


async def schema_storm(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    opts.storm_seed += 32  # a second run against the same server compiles anew too
    return await _storm(client, tally, [_schema(opts.storm_seed + i) for i in range(32)])


async def plain_storm(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    """Case 6's twin: the same 32 one-token requests without their schemas. Its probe ratio is
    what serving them costs the probe; case 6's ratio over it, what their grammars cost."""
    return await _storm(client, tally, [None] * 32)


async def _storm(client: Client, tally: Tally, schemas: list[dict | None]) -> list[str]:
    def body(schema: dict | None) -> dict:
        # One token each: the phase measures what compiling costs the others, not 32 more
        # sequences decoding beside the probe.
        plain = {"prompt": "A record as JSON:", "max_tokens": 1}
        if schema is None:
            return plain
        name = next(iter(schema["properties"]))
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema}}
        return {**plain, "response_format": fmt}

    storm = [_checked(client, tally, "/v1/completions", body(schema)) for schema in schemas]
    return list(await asyncio.gather(*storm))


async def echo_bound(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    huge = "x" * 1_000_000
    bodies = [
        {"prompt": "hi", "max_tokens": 4, "user": huge},
        {"prompt": "hi", "max_tokens": 4, "lane": huge},
        {"prompt": "hi", "max_tokens": 4, "guided_regex": "(" + huge},
        {"prompt": "hi", "max_tokens": 4, "model": huge},
        {"prompt": "hi", "max_tokens": 4, huge[:100_000]: 1, "temperature": "hot"},
    ]
    outcomes = [await _checked(client, tally, "/v1/completions", b) for b in bodies]
    tenant = {"X-Tenant": "t" * 6000}
    outcome, status, reply = await client.post_read("/v1/completions", bodies[0], headers=tenant)
    if status >= 400 and len(reply.get("error", {}).get("message", "")) > MAX_ERROR_MESSAGE:
        tally.wrong.append("X-Tenant echoed")
    return [*outcomes, outcome]


async def tool_calls(client: Client, tally: Tally, opts: argparse.Namespace) -> list[str]:
    """A new user's tool calls at temperature 0 (the model's own text differs by model: the
    checks are structural): each must end with parseable calls, no markup in content."""
    base = {"messages": WEATHER, "tools": TOOLS, "temperature": 0, "max_tokens": 200}
    cases = [
        ({"tool_choice": {"type": "function", "function": {"name": "get_weather"}}}, 1, "stop"),
        ({"tool_choice": "required", "parallel_tool_calls": False}, 1, "tool_calls"),
        ({"tool_choice": "required"}, 1, "tool_calls"),
        ({"tool_choice": "required", "max_tokens": 45}, 0, "length"),
    ]
    outcomes = []
    for extra, at_least, finish in cases:
        outcome, status, reply = await client.post_read("/v1/chat/completions", {**base, **extra})
        outcomes.append(outcome)
        if status == 200:
            _check_tool_reply(tally, extra, reply, at_least, finish)
    return outcomes


def _check_tool_reply(tally: Tally, extra: dict, reply: dict, at_least: int, finish: str) -> None:
    choice = reply["choices"][0]
    message = choice["message"]
    calls = message.get("tool_calls") or []
    label = json.dumps(extra)
    if "<tool_call>" in (message.get("content") or ""):
        tally.wrong.append(f"{label}: markup in content")
    if len(calls) < at_least or not all(_parses(c) for c in calls):
        tally.wrong.append(f"{label}: {len(calls)} parseable calls")
    if choice["finish_reason"] != finish:
        tally.wrong.append(f"{label}: finish_reason {choice['finish_reason']}")


def _parses(call: dict) -> bool:
    try:
        return isinstance(json.loads(call["function"]["arguments"]), dict)
    except (KeyError, TypeError, ValueError):
        return False


PHASES = [
    ("admin control (case 1)", control_plane),
    ("lone surrogates (case 2)", lone_surrogates),
    ("tool_choice shapes (case 3)", tool_choice_shapes),
    ("grammar bombs (case 4)", grammar_bombs),
    ("count bombs (case 4, refused before compiling)", count_bombs),
    ("stop flood, n=16 (case 5)", stop_flood),
    ("32 large schemas (case 6)", schema_storm),
    ("32 plain, case 6's twin", plain_storm),
    ("echoed inputs (case 7)", echo_bound),
    ("tool calls (case 8)", tool_calls),
]
