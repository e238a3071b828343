"""/v1/embeddings on the hand-computable mock (server/mock_engine.py: value d of an input's
vector is its last id plus d, or its mean id plus d with mean pooling, L2-normalized)."""

from __future__ import annotations

import base64
import math
import struct

import openai
import pytest
from server_harness import serve

from jserve.server.mock_engine import MockEngine


def _expected(base: float) -> list[float]:
    vector = [base + d for d in range(8)]
    norm = math.sqrt(sum(v * v for v in vector))
    return [v / norm for v in vector]


async def _embed(client, body: dict) -> tuple[int, dict]:
    response = await client.post("/v1/embeddings", json=body)
    return response.status, await response.json()


async def test_every_input_form_one_embedding_each_in_order():
    async with serve(MockEngine()) as client:
        one = (await _embed(client, {"input": "abc", "model": "mock-model"}))[1]
        texts = (await _embed(client, {"input": ["ab", "z"], "dimensions": 8}))[1]
        ids = (await _embed(client, {"input": [5, 6, 7]}))[1]
        id_lists = (await _embed(client, {"input": [[5], [1, 2, 40]]}))[1]
    assert one["object"] == "list" and one["model"] == "mock-model"
    assert one["data"] == [{"object": "embedding", "index": 0, "embedding": _expected(99)}]
    assert one["usage"] == {"prompt_tokens": 3, "total_tokens": 3}
    assert [d["embedding"] for d in texts["data"]] == [_expected(98), _expected(122)]
    assert [d["index"] for d in texts["data"]] == [0, 1]
    assert ids["data"][0]["embedding"] == _expected(7)
    assert [d["embedding"] for d in id_lists["data"]] == [_expected(5), _expected(40)]
    assert id_lists["usage"]["prompt_tokens"] == 4


async def test_mean_pooling_setting_and_base64_encoding():
    async with serve(MockEngine(), pooling_type="mean") as client:
        floats = (await _embed(client, {"input": [1, 2, 6]}))[1]
        b64 = (await _embed(client, {"input": [1, 2, 6], "encoding_format": "base64"}))[1]
    assert floats["data"][0]["embedding"] == _expected(3)
    raw = base64.b64decode(b64["data"][0]["embedding"])
    assert list(struct.unpack("<8f", raw)) == pytest.approx(_expected(3), abs=1e-7)


async def test_truncate_prompt_tokens_embeds_each_inputs_last_tokens():
    """vLLM's truncate_prompt_tokens: each input's last k ids are pooled (mean of [6, 7] is
    6.5, of [1, 2, 6, 7] 4) and counted; an input past max_model_len (256) is embedded cut."""
    async with serve(MockEngine(), pooling_type="mean") as client:
        body = {"input": [[1, 2, 6, 7], [7] * 300], "truncate_prompt_tokens": 2}
        cut = (await _embed(client, body))[1]
    assert [d["embedding"] for d in cut["data"]] == [_expected(6.5), _expected(7)]
    assert cut["usage"]["prompt_tokens"] == 4


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"input": "a", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", "must be -1"),
        (
            {"input": "a", "truncate_prompt_tokens": 257},
            "truncate_prompt_tokens",
            "at most max_model_len (256)",
        ),
        ({"input": []}, "input", "'input' must be"),
        ({"input": [1, "a"]}, "input", "'input' must be"),
        ({"input": ["a", ""]}, "input[1]", "input[1] is empty"),
        ({"input": [[1], [0x110000]]}, "input[1]", "input[1]"),
        ({"input": "a", "dimensions": 4}, "dimensions", "hidden size, 8"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "'float', 'base64'"),
        ({"input": ["ok", "x" * 300]}, "input[1]", "max_model_len"),
        ({"input": "a", "model": "other"}, "model", "does not exist"),
    ],
)
async def test_bad_input_is_a_4xx_naming_the_field(body, param, message):
    async with serve(MockEngine()) as client:
        status, error = await _embed(client, body)
    assert status in (400, 404), error
    assert error["error"]["param"] == param
    assert message in error["error"]["message"]


async def test_the_official_client_decodes_its_default_base64():
    async with serve(MockEngine()) as client:
        base_url = str(client.make_url("/v1"))
        async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as oai:
            result = await oai.embeddings.create(model="mock-model", input=["ab", "c"])
    assert [d.embedding for d in result.data] == [
        pytest.approx(_expected(98), abs=1e-7),
        pytest.approx(_expected(99), abs=1e-7),
    ]
    assert result.usage.prompt_tokens == 3
