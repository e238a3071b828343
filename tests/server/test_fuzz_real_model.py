"""Hypothesis fuzzing of a real `jserve serve` on SmolLM2: no input may hurt the service.

Each example sends one request whose fields are drawn from inside and far outside their valid
ranges (token ids, floats, int32 edges, lists, nesting, wrong types, wrong endpoints). After each
one: the answer is 200 (with a well-formed body or SSE stream) or a 4xx with an OpenAI-style
JSON error, and a fixed greedy request still gives its known text. At the end no request runs
and no KV block is held. Defect 1 of issue 10 (one request killed the engine for good) and a
lone surrogate in a prompt (a 500 inside the tokenizer once) are explicit examples, so they are
sent on every run. tests/server/test_fuzz_protocol.py fuzzes every field's shape, fast, on the
mock; this test is about what reaches the real engine.

Budget (tests/budgets.py): 50 examples (100 requests, besides the explicit ones) under the
default `ci` hypothesis profile, scaled by JSERVE_HYPOTHESIS_PROFILE; the `slow` test runs
the `thorough` budget (2000) on demand: `pytest -m slow tests/server/test_fuzz_real_model.py`.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from server_harness import metric

from bench.server_process import ServerProcess, jserve_command
from tests.budgets import THOROUGH, examples
from tests.shared_engine import engine_flags

ENGINE_FLAGS = engine_flags(max_waiting_requests=64, max_n=4)  # the shared engine's steps
VOCAB = 49152
KNOWN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
KNOWN_TEXT = " Paris.\n\nThe answer is:"  # SmolLM2-135M-Instruct, greedy, float32
DEFECT_1 = {"prompt": "Hi", "max_tokens": 4, "min_tokens": 1, "stop_token_ids": [2147483648]}

_EDGE_INTS = [0, 1, -1, 2**31 - 1, 2**31, -(2**31) - 1, 2**63, 2**64, 10**30, VOCAB - 1, VOCAB]
_EDGE_FLOATS = [0.0, -0.0, 1e-300, 1e-45, 1e38, 1e39, 1e308, -1e308, 0.5, 2.0000001]
JUNK = st.one_of(
    st.none(), st.booleans(), st.text(max_size=8), st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)  # fmt: skip
INTS = st.one_of(st.integers(-3, 4), st.sampled_from(_EDGE_INTS), st.integers(), JUNK)
FLOATS = st.one_of(st.floats(-3, 3), st.sampled_from(_EDGE_FLOATS), st.floats(allow_nan=True), JUNK)
IDS = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from(_EDGE_INTS), st.integers())
SMALL_MAX_TOKENS = st.one_of(st.integers(1, 4), st.sampled_from([0, -1, 2**31, 10**30]), JUNK)
FIELDS = {
    "max_tokens": SMALL_MAX_TOKENS.filter(lambda v: v is not None),  # null would fill 512
    "min_tokens": INTS,
    "n": st.one_of(st.integers(1, 3), st.sampled_from([0, 5, 500, 2**31]), JUNK),
    "temperature": FLOATS,
    "top_p": FLOATS,
    "top_k": INTS,
    "min_p": FLOATS,
    "presence_penalty": FLOATS,
    "frequency_penalty": FLOATS,
    "repetition_penalty": FLOATS,
    "seed": INTS,
    "logprobs": INTS,
    "stop": st.one_of(st.text(max_size=4), st.lists(st.text(max_size=4), max_size=3), JUNK),
    "stop_token_ids": st.one_of(st.lists(IDS, max_size=4), JUNK),
    "logit_bias": st.one_of(st.dictionaries(IDS.map(str), FLOATS, max_size=2), JUNK),
    "ignore_eos": st.one_of(st.booleans(), JUNK),
    "skip_special_tokens": st.one_of(st.booleans(), JUNK),
    "stream": st.booleans(),
    "priority": st.one_of(st.sampled_from(["interactive", "batch", "long", "vip"]), JUNK),
    "timeout": FLOATS,
    "echo": JUNK,
    "best_of": INTS,
    "model": st.one_of(st.just("SmolLM2-135M-Instruct"), st.text(max_size=6), JUNK),
}
PROMPTS = st.one_of(
    st.text(min_size=0, max_size=40),
    st.lists(IDS, min_size=0, max_size=12),
    st.lists(st.lists(IDS, max_size=3), max_size=3),
    JUNK,
)
MESSAGES = st.one_of(
    st.lists(
        st.fixed_dictionaries(
            {"role": st.sampled_from(["user", "system", "assistant", "tool", ""]),
             "content": st.one_of(st.text(max_size=30), JUNK)}
        ),
        max_size=3,
    ),
    JUNK,
)  # fmt: skip


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    """(path, raw body) of one adversarial request."""
    kind = draw(st.sampled_from(["completions"] * 6 + ["chat"] * 3 + ["tokens", "nested"]))
    if kind == "nested":  # deep JSON in some field, at times past the parser's recursion limit
        depth = draw(st.sampled_from([10, 500, 5000, 100_000]))
        value = "[" * depth + "]" * depth
        return "/v1/completions", f'{{"prompt": "Hi", "stop": {value}}}'.encode()
    if kind == "tokens":
        path = draw(st.sampled_from(["/tokenize", "/detokenize"]))
        body = {"tokens": draw(st.one_of(st.lists(IDS, max_size=5), JUNK))}
        if path == "/tokenize":
            body = {"prompt": draw(PROMPTS)}
        return path, json.dumps(body).encode()
    names = draw(st.lists(st.sampled_from(sorted(FIELDS)), max_size=4, unique=True))
    body = {name: draw(FIELDS[name]) for name in names}
    if kind == "chat":
        body = {"messages": draw(MESSAGES), "max_tokens": 3, **body}
        path = "/v1/chat/completions"
    else:
        body = {"prompt": draw(PROMPTS), **body}
        path = "/v1/completions"
    return path, json.dumps(body).encode()  # NaN and Infinity become invalid JSON tokens


@pytest.fixture(scope="module")
def base_url(shared_engine, tmp_path_factory):  # built first: it fills both caches
    log = Path(tmp_path_factory.mktemp("fuzz")) / "server.log"
    with ServerProcess(jserve_command(ENGINE_FLAGS), log) as server:
        yield server.base_url


def _post(url: str, raw: bytes) -> tuple[int, bytes, str]:
    request = urllib.request.Request(url, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.read(), response.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


def _check_answer(status: int, body: bytes, content_type: str) -> None:
    if status == 200 and content_type.startswith("text/event-stream"):
        events = body.decode().split("\n\n")
        assert events[-2:] == ["data: [DONE]", ""], body[-300:]
        for event in events[:-2]:
            assert "error" not in json.loads(event.removeprefix("data: ")), event
        return
    assert content_type.startswith("application/json"), (status, body[:300])
    payload = json.loads(body, parse_constant=lambda c: pytest.fail(f"{c} in {body[:300]!r}"))
    if status == 200:
        assert "error" not in payload, payload
        return
    assert 400 <= status < 500, (status, payload)
    error = payload["error"]
    assert isinstance(error["message"], str) and 0 < len(error["message"]) <= 512, payload
    assert error["type"].endswith("_error"), payload


def _known_text(base_url: str) -> str:
    status, body, _ = _post(f"{base_url}/v1/completions", json.dumps(KNOWN).encode())
    assert status == 200, body
    return json.loads(body)["choices"][0]["text"]


def _fuzz(base_url: str, budget: settings) -> None:
    assert _known_text(base_url) == KNOWN_TEXT

    @budget
    @given(case=requests())
    @example(case=("/v1/completions", json.dumps(DEFECT_1).encode()))
    @example(case=("/v1/completions", b'{"prompt": "Hi", "temperature": 1e400}'))
    @example(case=("/detokenize", json.dumps({"tokens": [2**70]}).encode()))
    @example(case=("/v1/completions", b'{"prompt": "Hi \\ud800", "max_tokens": 2}'))
    @example(case=("/tokenize", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'))
    def one_request(case: tuple[str, bytes]) -> None:
        path, raw = case
        _check_answer(*_post(f"{base_url}{path}", raw))
        assert _known_text(base_url) == KNOWN_TEXT, case

    one_request()
    with urllib.request.urlopen(f"{base_url}/metrics") as response:
        metrics = response.read().decode()
    assert metric(metrics, "jserve:num_requests_running") == 0
    assert metric(metrics, "jserve:num_requests_waiting") == 0
    assert metric(metrics, "jserve:kv_cache_usage_perc") == 0
    assert metric(metrics, "jserve:engine_restarts_total") == 0
    with urllib.request.urlopen(f"{base_url}/health") as response:
        assert json.loads(response.read()) == {"status": "ready"}


def test_fuzzed_requests_never_hurt_the_server(base_url):
    _fuzz(base_url, examples(50))


@pytest.mark.slow
def test_fuzzed_requests_never_hurt_the_server_long(base_url):
    """The thorough budget: test_fuzzed_requests_never_hurt_the_server covers it by default."""
    _fuzz(base_url, examples(200, THOROUGH))
