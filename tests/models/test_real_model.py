"""The default SmolLM2 model against transformers loading the same GGUF (float32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.hf_oracle import hf_greedy
from tests.models.dense_generate import generate_dense, greedy_choices, last_token_logits

LOGIT_TOL = 1e-3
GREEDY_TOKENS = 32

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
]
CHAT_PROMPTS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name three colors."},
    ],
]


def _prompt_ids(tokenizer) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in RAW_PROMPTS]
    for messages in CHAT_PROMPTS:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        ids.append(tokenizer.encode(text, add_special_tokens=False))
    return ids


@pytest.fixture(scope="module")
def prompts(default_model):
    return _prompt_ids(default_model.tokenizer)


def test_last_token_logits_match_transformers(prompts, default_placed, hf_default_model):
    graphdef, state = default_placed
    for ids in prompts:
        got = np.asarray(last_token_logits(graphdef, state, ids))
        with torch.no_grad():
            expected = hf_default_model(torch.tensor([ids])).logits[0, -1].numpy()
        assert np.abs(got - expected).max() < LOGIT_TOL, ids


def test_greedy_continuations_match_transformers(prompts, default_placed, hf_default_model):
    graphdef, state = default_placed
    for ids in prompts:
        # transformers' continuation (no stop token ends it), each token checked in one pass.
        expected = hf_greedy(hf_default_model, ids, GREEDY_TOKENS)
        assert greedy_choices(graphdef, state, ids, expected) == expected


def test_generation_stops_at_stop_token(default_model, default_placed):
    graphdef, state = default_placed
    tok = default_model.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "Say hi."}])
    ids = tok.encode(text, add_special_tokens=False)
    out = list(generate_dense(graphdef, state, ids, 64, stop_token_ids=tok.stop_token_ids))
    assert out[-1] in tok.stop_token_ids
    assert not set(out[:-1]) & tok.stop_token_ids
