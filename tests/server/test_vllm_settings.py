"""The server settings vLLM's serve flags reach (server/settings.py): --max-logprobs,
--no-enable-auto-tool-choice, --generation-config's sampling defaults, --enable-log-requests;
and the field a refused request names when the engine refuses it. Mock engine, no model."""

from __future__ import annotations

import json
import logging

import pytest

from jserve.errors import RejectReason, RequestRejected
from jserve.server.api_errors import rejection_to_api_error
from jserve.server.generation_config import sampling_defaults
from jserve.server.mock_engine import MockEngine
from jserve.server.protocol import RequestPolicy, parse_chat, parse_completion
from jserve.server.protocol_types import ChatRequest, CompletionRequest
from tests.server.server_harness import serve

HI = [{"role": "user", "content": "Hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]


async def _error(client, path: str, body: dict) -> tuple[int, dict]:
    response = await client.post(path, json=body)
    return response.status, (await response.json()).get("error")


async def test_max_logprobs_refuses_more_naming_the_field():
    async with serve(MockEngine(token_delay=0), max_logprobs=2) as client:
        status, error = await _error(
            client, "/v1/completions", {"prompt": "ab", "max_tokens": 2, "logprobs": 3}
        )
        assert (status, error["param"]) == (400, "logprobs")
        assert error["message"] == "logprobs must be at most 2 (the server's --max-logprobs), got 3"
        chat = {"messages": HI, "max_tokens": 2, "logprobs": True, "top_logprobs": 3}
        status, error = await _error(client, "/v1/chat/completions", chat)
        assert (status, error["param"]) == (400, "top_logprobs")
        ok = await client.post(
            "/v1/completions", json={"prompt": "ab", "max_tokens": 2, "logprobs": 2}
        )
        assert ok.status == 200
        assert len((await ok.json())["choices"][0]["logprobs"]["top_logprobs"][0]) == 2


async def test_auto_tool_choice_off_refuses_auto_as_vllm_does_and_serves_the_others():
    # The tool prompt is long: a context that holds it.
    engine = MockEngine(token_delay=0, max_model_len=2048)
    async with serve(engine, enable_auto_tool_choice=False) as client:
        for choice in ({}, {"tool_choice": "auto"}):
            body = {"messages": HI, "max_tokens": 2, "tools": TOOLS, **choice}
            status, error = await _error(client, "/v1/chat/completions", body)
            assert (status, error["param"]) == (400, "tool_choice"), choice
            assert "(--no-enable-auto-tool-choice)" in error["message"]
        body = {"messages": HI, "max_tokens": 2, "tools": TOOLS, "tool_choice": "none"}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200
    async with serve(engine) as client:  # on by default: jserve's habit
        body = {"messages": HI, "max_tokens": 2, "tools": TOOLS}
        assert (await client.post("/v1/chat/completions", json=body)).status == 200


async def test_enable_log_requests_logs_each_request_once(caplog):
    body = {"prompt": "abc", "max_tokens": 2, "temperature": 0.5}
    caplog.set_level(logging.INFO, logger="jserve.server.generation")
    async with serve(MockEngine(token_delay=0)) as client:
        assert (await client.post("/v1/completions", json=body)).status == 200
    assert "prompt tokens" not in caplog.text
    async with serve(MockEngine(token_delay=0), enable_log_requests=True) as client:
        assert (await client.post("/v1/completions", json=body)).status == 200
        traced = {**body, "request_id": "trace-9"}
        assert (await client.post("/v1/completions", json=traced)).status == 200
    logged = [r.getMessage() for r in caplog.records if "prompt tokens" in r.getMessage()]
    assert len(logged) == 2 and all(line.startswith("request cmpl-") for line in logged)
    # Without a caller's id the response's id is the engine's; with one, the line names both.
    engine_id = logged[0].split()[1]
    assert logged[0].startswith(f"request {engine_id} ({engine_id}): ")
    assert " (cmpl-trace-9): 3 prompt tokens, " in logged[1]
    assert ": 3 prompt tokens, lane interactive, tenant default, " in logged[0]
    assert "temperature=0.5" in logged[0]


def test_generation_config_defaults_fill_only_the_fields_a_request_leaves_out(tmp_path):
    config = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 99, "bos": 1}
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = sampling_defaults(str(tmp_path), None)
    assert defaults == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert sampling_defaults("auto", str(tmp_path)) == defaults  # the model's own directory
    assert sampling_defaults("auto", str(tmp_path / "model.gguf")) == {}  # a GGUF has none
    assert sampling_defaults("auto", None) == sampling_defaults("vllm", str(tmp_path)) == {}
    policy = RequestPolicy(sampling_defaults=defaults)
    left_out = parse_completion(CompletionRequest(prompt="a"), policy).params
    assert (left_out.temperature, left_out.top_p, left_out.top_k) == (0.6, 0.9, 20)
    given = parse_chat(ChatRequest(messages=[], temperature=0.0, top_k=3), policy).params
    assert (given.temperature, given.top_p, given.top_k) == (0.0, 0.9, 3)
    assert left_out.max_tokens == 16  # max_new_tokens is not read (see generation_config)


def test_generation_config_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"no generation_config\.json there"):
        sampling_defaults(str(tmp_path), None)
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        sampling_defaults(str(tmp_path), None)


@pytest.mark.parametrize(
    ("param", "fields", "expected"),
    [
        ("structured_outputs", {"structured_outputs": "response_format"}, "response_format"),
        ("structured_outputs", {"structured_outputs": "tools"}, "tools"),
        ("max_tokens", {"max_tokens": "max_completion_tokens"}, "max_completion_tokens"),
        ("n", {}, "n"),
        (None, {}, None),
    ],
)
def test_an_engine_refusal_names_the_requests_own_field(param, fields, expected):
    error = rejection_to_api_error(
        RequestRejected(RejectReason.INVALID, "bad", param=param), fields
    )
    assert (error.status, error.param, error.code) == (400, expected, "invalid")
