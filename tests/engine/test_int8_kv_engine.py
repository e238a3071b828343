"""The default model served with an int8 KV pool (--kv-cache-dtype int8): its greedy tokens
mostly the float32 pool's (measured, not asserted identical: the pool rounds K and V), no
compilation after start-up, and the pool's block count for the same memory."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.config.engine_args import EngineArgs
from jserve.engine.setup import step_shapes
from jserve.runtime.compilation import forbid_compilation
from jserve.sampling_params import SamplingParams
from tests.aot.test_compile import SMOLLM2_135M
from tests.engine.test_quantized_engine import PROMPTS
from tests.shared_engine import make_engine, run_to_completion

GREEDY_TOKENS = 24


@pytest.fixture(scope="module")
def int8_engine(default_model):
    return make_engine(default_model, kv_cache_dtype="int8")


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", {"prompt_token_ids": ids}, params)
    final = run_to_completion(engine)
    return [final[f"q{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def test_int8_pool_greedy_tokens_mostly_follow_the_float32_pool(int8_engine, engine):
    """Batched, through chunked prefill and preemption (the shared sizes). Greedy decoding
    amplifies any change once two candidates are close, so the check is the common prefix."""
    cache = int8_engine.runner.kv_cache
    assert [x.dtype for x in cache] == [jnp.int8, jnp.int8, jnp.float32, jnp.float32]
    assert int8_engine.kv_cache_dtype == "int8" and engine.kv_cache_dtype == "float32"
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    quantized, floats = _greedy(int8_engine, prompts), _greedy(engine, prompts)
    common = [_common_prefix(a, b) for a, b in zip(quantized, floats, strict=True)]
    print(f"common prefix with the float32 pool: {common} of {GREEDY_TOKENS}")
    assert np.mean(common) >= GREEDY_TOKENS / 2, common
    assert sum(c == GREEDY_TOKENS for c in common) >= len(PROMPTS) // 2 + 1, common


def test_int8_pool_serves_without_compiling(int8_engine):
    rng = np.random.default_rng(0)
    with forbid_compilation():
        for i in range(12):
            prompt = [int(t) for t in rng.integers(100, 5000, size=int(rng.integers(1, 120)))]
            params = SamplingParams(
                temperature=float(rng.choice([0.0, 0.8])),
                max_tokens=int(rng.integers(1, 16)),
                ignore_eos=True,
            )
            int8_engine.add_request(f"c{i}", {"prompt_token_ids": prompt}, params)
        final = run_to_completion(int8_engine)
    assert len(final) == 12


@pytest.mark.parametrize(
    ("dtype", "ratio"),
    # bytes per token and KV head: D elements of the pool against D int8 + a float32 scale
    [("float32", 64 * 4 / 68), ("bfloat16", 64 * 2 / 68)],
)
def test_the_same_memory_holds_more_int8_blocks(dtype, ratio):
    memory = 1 << 30
    args = EngineArgs(kv_cache_memory=memory, dtype=dtype)
    int8_args = EngineArgs(kv_cache_memory=memory, dtype=dtype, kv_cache_dtype="int8")
    floats, int8 = (step_shapes(a, SMOLLM2_135M, "cpu") for a in (args, int8_args))
    # SmolLM2: 30 layers x 3 KV heads x 16 tokens, K and V
    assert int8.block_bytes == 2 * 30 * 3 * 16 * (64 + 4)
    assert int8.num_blocks == memory // int8.block_bytes
    assert int8.num_blocks / floats.num_blocks == pytest.approx(ratio, rel=1e-3)


def test_int8_pool_refuses_an_attention_that_cannot_read_it():
    args = EngineArgs(kv_cache_dtype="int8", attention_impl="mosaic")
    with pytest.raises(ValueError, match="int8 is read by --attention-impl reference, xla"):
        step_shapes(args, SMOLLM2_135M, "tpu")
