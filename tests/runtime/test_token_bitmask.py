"""The grammar bitmask on device against llguidance's numpy reference, and the sampler's use
of it: constrained rows draw only allowed tokens, unconstrained rows are untouched, and the
same executables serve no, some or all rows constrained (no compile)."""

from __future__ import annotations

import jax.numpy as jnp
import llguidance.numpy as llg_numpy
import numpy as np
import pytest

from jserve.runtime.compilation import forbid_compilation
from jserve.runtime.sampler import apply_token_bitmask
from jserve.runtime.sampling_tensors import SamplingRow, bitmask_width
from jserve.sampling_params import SamplingParams
from tests.runtime.conftest import V  # the shared sampler's vocabulary


def random_bitmask(rng: np.random.Generator, rows: int, density: float) -> np.ndarray:
    bits = rng.random((rows, bitmask_width(V) * 32)) < density
    bits[:, 0] |= ~bits[:, :V].any(-1)  # at least one allowed token per row
    return np.packbits(bits, axis=1, bitorder="little").view(np.int32)


def reference(logits: np.ndarray, bitmask: np.ndarray) -> np.ndarray:
    out = logits.copy()
    llg_numpy.apply_token_bitmask_inplace(out, bitmask)
    return out


@pytest.mark.parametrize("density", [0.0, 0.01, 0.5, 1.0])
def test_bitmask_matches_llguidance_numpy_reference(density):
    rng = np.random.default_rng(int(density * 100))
    logits = rng.standard_normal((5, V)).astype(np.float32)
    bitmask = random_bitmask(rng, 5, density)
    bitmask[2] = -1  # an unconstrained row
    got = np.asarray(apply_token_bitmask(jnp.asarray(logits), jnp.asarray(bitmask)))
    np.testing.assert_array_equal(got, reference(logits, bitmask))
    np.testing.assert_array_equal(got[2], logits[2])


def _rows(bitmask: np.ndarray, constrained: list[bool], temperature: float) -> list[SamplingRow]:
    params = SamplingParams(temperature=temperature, max_tokens=8, logprobs=0)
    return [
        SamplingRow(params, None, (), [1] * i, (), bitmask[i] if c else None)  # fresh draws
        for i, c in enumerate(constrained)
    ]


@pytest.mark.parametrize("constrained", [[False] * 6, [True, False] * 3, [True] * 6])
def test_sampler_draws_only_allowed_tokens_without_compiling(sampler, constrained):
    rng = np.random.default_rng(len(constrained) + sum(constrained))
    logits = rng.standard_normal((8, V)).astype(np.float32) * 3
    bitmask = random_bitmask(rng, 6, 0.02)
    masked = reference(logits[:6], bitmask)
    on_device = jnp.asarray(logits)  # jnp.asarray compiles
    with forbid_compilation():
        greedy = sampler.sample(on_device, _rows(bitmask, constrained, 0.0))
        drawn = [
            sampler.sample(on_device, _rows(bitmask, constrained, 1.0)).tokens for _ in range(3)
        ]
    for i, c in enumerate(constrained):
        expected = np.argmax(masked[i]) if c else np.argmax(logits[i])
        assert greedy.tokens[i] == expected
        # logprobs stay the model's raw ones (vLLM's default), constrained or not
        raw = logits[i] - np.log(np.exp(logits[i].astype(np.float64)).sum())
        np.testing.assert_allclose(greedy.sampled_logprob[i], raw[greedy.tokens[i]], atol=1e-4)
        if c:
            assert all(np.isfinite(masked[i, tokens[i]]) for tokens in drawn)
