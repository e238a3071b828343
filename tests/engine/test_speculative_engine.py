"""Speculative decoding on the real model: greedy and seeded sampled outputs token for token
those of the same engine without it (stops, max_tokens cut inside an accepted run, n > 1,
logprobs, penalties, min_tokens, top-k/top-p, a constrained request beside, preemption), for
the ngram and suffix methods, in fewer steps, with no compilation (the step-cost rule picks
among the precompiled buckets), with the acceptance counted.

Speculation is switched on the shared engine by its scheduler's config (the step shapes are
the same with and without it) and switched back off before the test ends.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import SamplingParams, StructuredOutputsParams
from tests.shared_engine import assert_no_blocks_held

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4})
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 4})
COPY = "Copy this list exactly:\n" + "".join(
    f"- item {i}: apple, banana, cherry\n" for i in range(8)
)
CODE = (
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
)


@contextlib.contextmanager
def speculating(engine, spec: str = SPEC) -> Iterator[None]:
    """The engine, fresh (empty prefix cache), with `spec` until the block ends."""
    config = engine.scheduler.config
    engine.scheduler.reconfigure(dataclasses.replace(config, speculative_config=spec))
    engine.reset()
    try:
        yield
    finally:
        engine.scheduler.reconfigure(config)


def _run(engine, requests) -> tuple[dict, int]:
    """Each request's (token ids, text, finish and stop reason, top logprob ids) per sample,
    and the steps taken."""
    for request_id, prompt, params in requests:
        engine.add_request(request_id, prompt, params)
    final, steps = {}, 0
    with forbid_compilation():
        while engine.has_unfinished_requests():
            steps += 1
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = [_summary(c) for c in out.outputs]
    assert_no_blocks_held(engine)
    return final, steps


def _summary(c) -> tuple:
    tops = None if c.logprobs is None else [sorted(lp) for lp in c.logprobs]
    return tuple(c.token_ids), c.text, c.finish_reason, c.stop_reason, tops


def _requests(tokenizer) -> list[tuple]:
    greedy = dict(temperature=0.0, max_tokens=48)
    copy_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": COPY}]),
        add_special_tokens=False,
    )
    return [
        ("copy", {"prompt_token_ids": copy_ids}, SamplingParams(**greedy)),
        ("code", CODE, SamplingParams(**greedy, ignore_eos=True)),
        ("list", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,", SamplingParams(**greedy)),
        # max_tokens ends it inside a run of accepted drafts; a stop string after the fact.
        ("short", CODE, SamplingParams(temperature=0.0, max_tokens=7)),
        ("stop", COPY, SamplingParams(**greedy, stop=["item 10"])),
        ("two", CODE, SamplingParams(**greedy, n=2, logprobs=2)),
        # Seeded sampling: each row's draw is the one decoding one token at a time makes.
        ("sampled", COPY, SamplingParams(temperature=0.8, seed=7, max_tokens=32)),
        ("top", CODE, SamplingParams(temperature=0.7, top_k=5, top_p=0.9, seed=3, max_tokens=32)),
        (
            "penalized",
            COPY,
            SamplingParams(
                temperature=0.5,
                seed=11,
                max_tokens=32,
                repetition_penalty=1.1,
                presence_penalty=0.2,
                min_tokens=20,
            ),
        ),
        # Not speculated, but in the same batches: a constrained request.
        (
            "choice",
            "Is the sky blue? Answer:",
            SamplingParams(
                temperature=0.0, structured_outputs=StructuredOutputsParams(choice=["yes", "no"])
            ),
        ),
    ]


def test_speculation_gives_the_same_tokens_in_fewer_steps(engine):
    requests = _requests(engine.tokenizer)
    plain, plain_steps = _run(engine, requests)
    assert plain["short"][0][2] == "length" and len(plain["short"][0][0]) == 7
    assert plain["stop"][0][3] == "item 10"
    assert plain["two"][0] == plain["two"][1] and plain["two"][0][4] is not None
    for spec in (SPEC, SUFFIX):
        before = engine.stats()
        with speculating(engine, spec):
            spec_out, spec_steps = _run(engine, requests)
        after = engine.stats()
        assert spec_out == plain, spec
        drafts = after.spec_decode_num_drafts - before.spec_decode_num_drafts
        drafted = after.spec_decode_num_draft_tokens - before.spec_decode_num_draft_tokens
        accepted = after.spec_decode_num_accepted_tokens - before.spec_decode_num_accepted_tokens
        assert 0 < accepted < drafted <= 4 * drafts, spec
        per_pos = after.spec_decode_num_accepted_tokens_per_pos
        assert sum(per_pos) == after.spec_decode_num_accepted_tokens
        assert per_pos == sorted(per_pos, reverse=True)  # position j accepted only after j - 1
        # Every accepted draft saved one step of some request: the run is shorter.
        assert spec_steps < plain_steps, spec


def test_preempted_speculating_requests_recompute_the_same_tokens(engine):
    """48 blocks of 16 cannot hold 8 requests of ~200 tokens: speculating requests are
    preempted and recomputed, and still decode exactly as without speculation."""
    header = "Copy this list exactly:\n"
    prompts = [header + "".join(f"- {i}{j}: x y z\n" for j in range(24)) for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [(f"p{i}", prompt, params) for i, prompt in enumerate(prompts)]
    plain, _ = _run(engine, requests)
    accepted = engine.spec_decode.num_accepted_tokens
    with speculating(engine):
        spec, _ = _run(engine, requests)
        assert engine.scheduler.stats().num_preemptions > 0
    assert engine.spec_decode.num_accepted_tokens > accepted
    assert spec == plain
