"""The official `openai` client against the mock server: what users will actually run."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import openai
import pytest
from server_harness import chat_prompt, echo_text, serve

from jserve.server.mock_engine import MockEngine

HI = [{"role": "user", "content": "Hi"}]


@contextlib.asynccontextmanager
async def _openai_client(engine: MockEngine, **app_kwargs) -> AsyncIterator[openai.AsyncOpenAI]:
    async with serve(engine, **app_kwargs) as client:
        api_key = app_kwargs.get("api_key") or "unused"
        base_url = str(client.make_url("/v1"))
        async with openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0) as oai:
            yield oai


async def test_completions_stream_and_not():
    async with _openai_client(MockEngine(token_delay=0.001)) as oai:
        full = await oai.completions.create(
            model="mock-model", prompt="Hello", max_tokens=7, n=2, logprobs=1, stop=["zz"]
        )
        stream = await oai.completions.create(
            model="mock-model", prompt="Hello", max_tokens=7, stream=True,
            stream_options={"include_usage": True},
        )  # fmt: skip
        chunks = [chunk async for chunk in stream]
    assert [c.text for c in sorted(full.choices, key=lambda c: c.index)] == ["HelloHe", "elloHel"]
    assert full.choices[0].logprobs.tokens == list("HelloHe")
    assert full.usage.completion_tokens == 14
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "HelloHe"
    assert chunks[-1].usage.total_tokens == 12


async def test_chat_stream_and_not():
    expected = echo_text(chat_prompt(HI), 6)
    async with _openai_client(MockEngine(token_delay=0.001), api_key="k") as oai:
        full = await oai.chat.completions.create(
            model="mock-model", messages=HI, max_completion_tokens=6, logprobs=True,
            top_logprobs=2, seed=1, temperature=0.7, user="someone",
        )  # fmt: skip
        stream = await oai.chat.completions.create(
            model="mock-model", messages=HI, max_tokens=6, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert full.choices[0].message.content == expected
    assert full.choices[0].message.role == "assistant"
    assert [len(t.top_logprobs) for t in full.choices[0].logprobs.content] == [2] * 6
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length"


async def test_models_and_errors_surface_as_openai_exceptions():
    async with _openai_client(MockEngine(), max_body_bytes=10_000) as oai:
        assert [m.id async for m in oai.models.list()] == ["mock-model"]
        with pytest.raises(openai.NotFoundError):
            await oai.completions.create(model="gpt-4", prompt="a")
        with pytest.raises(openai.BadRequestError, match="temperature must be a finite number in"):
            await oai.completions.create(model="mock-model", prompt="a", temperature=-1)
        with pytest.raises(openai.BadRequestError, match="max_model_len"):
            await oai.completions.create(model="mock-model", prompt="x" * 300)
