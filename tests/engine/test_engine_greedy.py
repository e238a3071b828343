"""Continuous batching on the real model gives transformers' greedy tokens, under pressure.

With max_num_seqs=8, a 64-token step and a 48-block pool, 16 prompts of 5 to ~400 tokens go
through chunked prefill and preemption; every request's tokens must still equal transformers'
greedy continuation of that prompt alone.
"""

from __future__ import annotations

from jserve.sampling_params import SamplingParams
from tests.engine.conftest import assert_no_blocks_held, run_to_completion
from tests.hf_oracle import hf_greedy

NUM_TOKENS = 32
PARAGRAPH = (
    "The history of computing is a story of ideas meeting machines. Early calculators were "
    "mechanical, then electrical, and finally electronic; each step made arithmetic faster. "
)


def _prompts(tokenizer) -> list[list[int]]:
    raw = [
        "Hi there, how are",
        "The capital of France is",
        "def add(a, b):\n    return",
        "1, 2, 3, 4,",
        "Once upon a time in a small village",
        PARAGRAPH * 2 + "In summary,",
        PARAGRAPH * 6 + "The most important idea was",
        PARAGRAPH * 14 + "Therefore",
    ]
    chats = [
        [{"role": "user", "content": "What is 2 + 2?"}],
        [{"role": "user", "content": "Name a fruit."}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}],
        [{"role": "user", "content": "Write a haiku about the sea."}],
        [{"role": "user", "content": PARAGRAPH * 3 + "Summarize this."}],
        [{"role": "user", "content": "List three colors."}],
        [{"role": "user", "content": PARAGRAPH * 10 + "What is this about?"}],
        [{"role": "user", "content": "Why is the sky blue?"}],
    ]
    ids = [tokenizer.encode(p) for p in raw]
    ids += [
        tokenizer.encode(tokenizer.apply_chat_template(c), add_special_tokens=False) for c in chats
    ]
    return ids


def test_batched_greedy_matches_transformers(tight_engine, hf_default_model):
    engine = tight_engine
    prompts = _prompts(engine.tokenizer)
    lengths = sorted(len(p) for p in prompts)
    assert 5 <= lengths[0] <= 8 and 380 <= lengths[-1] <= 450, lengths
    params = SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True)
    preemptions_before = engine.scheduler.stats().num_preemptions
    for i, ids in enumerate(prompts):
        engine.add_request(f"g{i}", {"prompt_token_ids": ids}, params)
    final = run_to_completion(engine)
    assert engine.scheduler.stats().num_preemptions > preemptions_before  # the pool was tight
    for i, ids in enumerate(prompts):
        expected = hf_greedy(hf_default_model, ids, NUM_TOKENS)
        got = final[f"g{i}"].outputs[0].token_ids
        assert got == expected, f"prompt {i} ({len(ids)} tokens)"
    assert_no_blocks_held(engine)
