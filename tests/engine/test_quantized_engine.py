"""The default model served as its GGUF's packed Q4_1/Q8_0 blocks (--quantization auto) gives
the float32 path's greedy tokens, batched, through chunked prefill and preemption, from a
fifth of the float32 weights' bytes; and where --quantization auto packs at all."""

from __future__ import annotations

import pytest

from jserve.config.engine_args import EngineArgs
from jserve.engine.setup import packs_quantized_blocks, weight_bytes
from jserve.loaders.model_source import load_model
from jserve.pallas import native_build
from jserve.sampling_params import SamplingParams
from tests.shared_engine import make_engine, run_to_completion

PARAGRAPH = (
    "The history of computing is a story of ideas meeting machines. Early calculators were "
    "mechanical, then electrical, and finally electronic; each step made arithmetic faster. "
)
PROMPTS = [
    "The capital of France is",
    "def add(a, b):\n    return",
    "Once upon a time in a small village",
    PARAGRAPH * 6 + "The most important idea was",
    PARAGRAPH * 14 + "Therefore",
]


@pytest.fixture(scope="module")
def packed_engine():
    if native_build.load() is None:
        pytest.skip("the native CPU kernels cannot be built here (see the log)")
    return make_engine(load_model(None, packed=True))


def _greedy(engine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    for i, ids in enumerate(prompts):
        engine.add_request(f"q{i}", {"prompt_token_ids": ids}, params)
    final = run_to_completion(engine)
    return [final[f"q{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_packed_blocks_give_the_float32_greedy_tokens(packed_engine, engine):
    assert packed_engine.quantization == "gguf:Q4_1,Q8_0"
    assert engine.quantization == "none"
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    assert _greedy(packed_engine, prompts) == _greedy(engine, prompts)
    packed, floats = (weight_bytes(e.runner.state) for e in (packed_engine, engine))
    assert packed <= 0.2 * floats, (packed, floats)


@pytest.mark.parametrize(
    ("settings", "platform", "packs"),
    [
        ({}, "cpu", True),
        ({"quantization": "none"}, "cpu", False),
        ({"dtype": "bfloat16"}, "cpu", False),  # the native kernels are float32's
        ({"tensor_parallel_size": 2}, "cpu", False),  # ... and one device's
        ({}, "tpu", False),  # XLA runs the dequantized weights there
    ],
)
def test_auto_packs_where_the_native_kernel_runs_the_projections(settings, platform, packs):
    if native_build.load() is None:
        pytest.skip("the native CPU kernels cannot be built here (see the log)")
    assert packs_quantized_blocks(EngineArgs(**settings), platform) == packs
