"""Engine fixtures: one small-budget engine on the real model, shared by a module's tests."""

from __future__ import annotations

import pytest

from jserve.config.engine_args import EngineArgs
from jserve.engine.llm_engine import LLMEngine

# Tight on purpose: a 64-token step forces chunked prefill of long prompts, and 48 blocks of 16
# tokens (768 slots) cannot hold 8 sequences of up to ~430 tokens, forcing preemption.
TIGHT = dict(max_num_seqs=8, max_num_batched_tokens=64, num_kv_blocks=49, max_model_len=512)


def make_engine(default_model, **overrides) -> LLMEngine:
    return LLMEngine(EngineArgs(**{**TIGHT, **overrides}), loaded=default_model)


def run_to_completion(engine: LLMEngine, max_steps: int = 100_000) -> dict:
    """Step until idle; returns request id -> final RequestOutput."""
    final = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"engine still busy after {max_steps} steps")


def assert_no_blocks_held(engine: LLMEngine) -> None:
    """Every KV block is free or an evictable prefix-cache entry once nothing runs."""
    assert not engine.has_unfinished_requests()
    stats = engine.scheduler.stats()
    assert stats.kv_cache_usage == 0.0, stats


@pytest.fixture(scope="module")
def tight_engine(default_model):
    engine = make_engine(default_model)
    yield engine
    assert_no_blocks_held(engine)
