"""Continuous batching on the real model gives transformers' greedy tokens, under pressure.

With max_num_seqs=8, a 64-token step and a 48-block pool, 16 prompts of 5 to ~400 tokens go
through chunked prefill and preemption; every request's tokens must still equal transformers'
greedy continuation of that prompt alone. The same engine's step observers see every model
step with the sizes the scheduler planned, and sync a step only when one asks for its time.
"""

from __future__ import annotations

import jax
import pytest

from jserve.sampling_params import SamplingParams
from tests.hf_oracle import hf_greedy_choices
from tests.shared_engine import assert_no_blocks_held, run_to_completion

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


def test_batched_greedy_matches_transformers(engine, hf_default_model):
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
        got = final[f"g{i}"].outputs[0].token_ids
        assert len(got) == NUM_TOKENS
        assert hf_greedy_choices(hf_default_model, ids, got) == got, f"prompt {i} ({len(ids)})"
    assert_no_blocks_held(engine)


def _planned_sizes(engine, monkeypatch) -> list[tuple]:
    """Wrap the scheduler: each non-empty plan's (tokens, seqs, decodes, q lens, kv lens)."""
    planned, schedule = [], engine.scheduler.schedule

    def recording_schedule(*args, **kwargs):
        plan = schedule(*args, **kwargs)
        if not plan.is_empty:
            q = [len(seq.token_ids) for seq in plan.seqs]
            kv = [seq.start_pos + n for seq, n in zip(plan.seqs, q, strict=True)]
            planned.append((plan.num_batched_tokens, len(plan.seqs), plan.num_decodes, q, kv))
        return plan

    monkeypatch.setattr(engine.scheduler, "schedule", recording_schedule)
    return planned


def test_step_observers_see_every_model_step_and_sync_only_when_asked(engine, monkeypatch):
    syncs = []
    block_until_ready = jax.block_until_ready
    monkeypatch.setattr(jax, "block_until_ready", lambda x: syncs.append(1) or block_until_ready(x))
    planned = _planned_sizes(engine, monkeypatch)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt_lens = (5, 70, 150)  # within one 64-token step, over two, over three

    def generate(first_id: int) -> list:
        """Distinct prompts each run (no prefix hits); the plans of the run's steps."""
        before = len(planned)
        for k, n in enumerate(prompt_lens):
            ids = list(range(first_id + 200 * k, first_id + 200 * k + n))
            engine.add_request(f"p{first_id}-{n}", {"prompt_token_ids": ids}, params)
        run_to_completion(engine)
        return planned[before:]

    assert generate(1000) and not syncs  # no observer: no sync besides the engine's own
    untimed, timed = [], []
    engine.add_step_observer(untimed.append)
    second = generate(2000)
    assert len(untimed) == len(second) and not syncs
    engine.add_step_observer(timed.append, runner_time=True)
    third = generate(3000)
    assert len(syncs) == len(timed) == len(third)  # one sync a step, for both observers
    assert all(a is b for a, b in zip(untimed[len(second) :], timed, strict=True))
    engine.remove_step_observer(timed.append)
    engine.remove_step_observer(untimed.append)
    with pytest.raises(ValueError, match="not a step observer"):
        engine.remove_step_observer(untimed.append)
    generate(4000)
    assert len(untimed) == len(second) + len(third) and len(syncs) == len(third)

    for step, (tokens, seqs, decodes, q, kv) in zip(untimed, second + third, strict=True):
        assert (step.num_tokens, step.num_seqs, step.num_decodes) == (tokens, seqs, decodes)
        assert step.q_lens.tolist() == q and step.kv_lens.tolist() == kv
        assert step.token_bucket in engine.inputs_builder.token_buckets
        assert step.token_bucket >= tokens and step.seq_bucket >= seqs
    assert all(step.runner_s is None for step in untimed[: len(second)])
    assert all(step.runner_s > 0 for step in timed)
    # Every prompt token and every fed-back output token (all but each last) once.
    fed = sum(prompt_lens) + len(prompt_lens) * (params.max_tokens - 1)
    assert sum(int(step.q_lens.sum()) for step in timed) == fed
    assert_no_blocks_held(engine)
