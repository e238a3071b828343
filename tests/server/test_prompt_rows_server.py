"""Embeddings, prompt logprobs and echo end to end: the official openai client, the server and
the real engine (the session's shared one) through AsyncLLMEngine."""

from __future__ import annotations

import numpy as np
import openai
from server_harness import serve

from jserve.engine.async_engine import AsyncLLMEngine
from jserve.sampling_params import PoolingParams
from tests.shared_engine import assert_no_blocks_held, run_to_completion

TEXTS = ["The capital of France is Paris.", "Hello"]


async def test_embeddings_and_echoed_logprobs_through_the_official_client(engine):
    aengine = AsyncLLMEngine(engine)
    try:
        async with serve(aengine) as client:
            base_url = str(client.make_url("/v1"))
            async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as oai:
                embedded = await oai.embeddings.create(model=engine.model_name, input=TEXTS)
                echoed = await oai.completions.create(
                    model=engine.model_name, prompt=TEXTS[0], max_tokens=4, temperature=0,
                    echo=True, logprobs=2, extra_body={"prompt_logprobs": 1},
                )  # fmt: skip
    finally:
        await aengine.shutdown()
    ids = [engine.tokenizer.encode(text) for text in TEXTS]
    assert embedded.usage.prompt_tokens == sum(map(len, ids))
    for i, prompt in enumerate(ids):  # the same as the offline engine's, alone
        engine.add_request(f"alone{i}", {"prompt_token_ids": prompt}, pooling=PoolingParams())
    alone = run_to_completion(engine)
    for i, data in enumerate(embedded.data):
        np.testing.assert_allclose(data.embedding, alone[f"alone{i}"].embedding, atol=1e-5)
        assert abs(np.linalg.norm(data.embedding) - 1.0) < 1e-5
        assert len(data.embedding) == engine.model_config.hidden_size
    choice = echoed.choices[0]
    logprobs = choice.logprobs
    n = len(ids[0])
    assert choice.text.startswith(TEXTS[0]) and "".join(logprobs.tokens) == choice.text
    assert len(logprobs.tokens) == n + 4 and logprobs.token_logprobs[0] is None
    assert logprobs.top_logprobs[0] is None
    assert logprobs.text_offset == sorted(logprobs.text_offset)
    assert logprobs.text_offset[n] == len(TEXTS[0])
    scored = choice.model_extra["prompt_logprobs"]  # vLLM's field, aligned with the prompt
    assert len(scored) == n and scored[0] is None
    for position in range(1, n):
        entry = scored[position][str(ids[0][position])]
        assert entry["logprob"] == logprobs.token_logprobs[position]
        assert entry["rank"] >= 1 and entry["decoded_token"] == logprobs.tokens[position]
    assert_no_blocks_held(engine)
