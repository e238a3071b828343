"""LLMEngine.reset starts an idle engine over with its settings kept, and the shared engine's
check (tests/shared_engine.py) catches each thing a test may leave behind."""

from __future__ import annotations

import re

import jax
import pytest

from jserve.sampling_params import SamplingParams
from tests.shared_engine import EngineState, assert_left_as_found, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
PROMPT = list(range(500, 548))  # three full blocks of 16


def _greedy(engine, request_id: str) -> list[int]:
    engine.add_request(request_id, {"prompt_token_ids": PROMPT}, GREEDY)
    return run_to_completion(engine)[request_id].outputs[0].token_ids


def test_reset_forgets_the_prefix_cache_and_keeps_the_settings(engine):
    first = _greedy(engine, "first")
    assert _greedy(engine, "cached") == first and engine.stats().prefix_cache_hits > 0
    engine.add_request("busy", {"prompt_token_ids": PROMPT}, GREEDY)
    with pytest.raises(RuntimeError, match="abort them first"):
        engine.reset()
    engine.abort_request("busy")
    watermark = engine.scheduler_settings()["free_block_watermark"]
    engine.control({"free_block_watermark": 0.05})
    try:
        engine.reset()
        assert engine.scheduler_settings()["free_block_watermark"] == 0.05
    finally:
        engine.control({"free_block_watermark": watermark})
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions) == (0, 0, 0)
    assert _greedy(engine, "again") == first and engine.stats().prefix_cache_hits == 0


def _leave_a_request(engine):
    engine.add_request("left", "Hi", GREEDY)
    return lambda: engine.abort_request("left")


def _leave_a_setting(engine):
    before = engine.scheduler_settings()["max_num_seqs"]
    engine.control({"max_num_seqs": before // 2})
    return lambda: engine.control({"max_num_seqs": before})


def _leave_an_observer(engine):
    def observer(step):
        return None

    engine.add_step_observer(observer)
    return lambda: engine.remove_step_observer(observer)


def _leave_a_patch(engine):
    engine.runner.run = lambda inputs: None
    return lambda: delattr(engine.runner, "run")


def _leave_a_deleted_pool(engine):
    jax.block_until_ready(engine.runner.kv_cache)
    engine.runner.kv_cache[0].delete()
    return engine.runner.reset_kv_cache


@pytest.mark.parametrize(
    ("leave", "names"),
    [
        (_leave_a_request, "unfinished requests: ['left']"),
        (_leave_a_setting, "'control_settings']"),
        (_leave_an_observer, "changed: ['observers']"),
        (_leave_a_patch, "changed: ['patched']"),
        (_leave_a_deleted_pool, "changed: ['pool_deleted']"),
    ],
)
def test_the_shared_engine_check_catches_what_a_test_leaves(engine, leave, names):
    before = EngineState.of(engine)
    undo = leave(engine)
    try:
        with pytest.raises(AssertionError, match=re.escape(names)):
            assert_left_as_found(engine, before)
    finally:
        undo()
    assert_left_as_found(engine, before)
