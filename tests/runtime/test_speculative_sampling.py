"""Speculative decoding keeps the target distribution: a chi-square over many seeded draws of a
verify step with two drafts, at the sampler with synthetic logits on a three-token vocabulary.

Each draw samples the verify step's three rows as the engine does (each row's history holds
the drafts before it, so its seeded uniforms are those of that output position), then keeps
what `num_accepted` accepts plus the target's token after it. Exact verification makes the
tokens a step keeps follow the chain of target distributions: the first ~ p0; after the
first draft, the second ~ p1; after both, the third ~ p2. The test must fail for a wrong rule:
planted bugs (every draft accepted; a bonus taken from the wrong row) are rejected by the same
statistic with an overwhelming margin: every draft accepted, and rows that all draw with the
first row's uniforms (drafts left out of their histories).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence

import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chisquare

from jserve.engine.spec_decode import num_accepted
from jserve.runtime.sampling_tensors import SamplingRow
from jserve.sampling_params import SamplingParams
from tests.runtime.conftest import BUCKETS, V

DRAFTS = (0, 1)
# Target distributions of the three rows over tokens 0..2 (every other token: probability 0).
P = np.array([[0.5, 0.3, 0.2], [0.3, 0.5, 0.2], [0.2, 0.3, 0.5]])
DRAWS = 2000
PER_CALL = BUCKETS[-1] // 3  # draws per sampler call, three rows each


def _expected(p: np.ndarray) -> dict[tuple[int, ...], float]:
    """Probability of each kept run: stopped at the first row whose token is not the draft."""
    expected = {}
    for first in range(3):
        if first != DRAFTS[0]:
            expected[(first,)] = p[0, first]
            continue
        for second in range(3):
            if second != DRAFTS[1]:
                expected[(first, second)] = p[0, first] * p[1, second]
                continue
            for third in range(3):
                expected[(first, second, third)] = p[0, first] * p[1, second] * p[2, third]
    return expected


HISTORIES = ((), DRAFTS[:1], DRAFTS)  # row j's output holds the drafts before it


def _kept_runs(
    sampler, params: SamplingParams, verify: Callable = num_accepted, histories=HISTORIES
) -> Counter:
    """Kept token runs of DRAWS seeded verify steps, as `verify(drafts, targets)` keeps them."""
    logits = np.full((BUCKETS[-1], V), -1e9, np.float32)
    for i in range(PER_CALL):
        logits[3 * i : 3 * i + 3, :3] = np.log(P)
    logits = jnp.asarray(logits)
    runs: Counter = Counter()
    for start in range(0, DRAWS, PER_CALL):
        seeds = range(start, start + PER_CALL)
        rows = [SamplingRow(params, seed, (7,), history) for seed in seeds for history in histories]
        tokens = sampler.sample(logits, rows).tokens.tolist()
        for i in range(PER_CALL):
            targets = tokens[3 * i : 3 * i + 3]
            runs[tuple(targets[: verify(DRAFTS, targets) + 1])] += 1
    return runs


def _fits(runs: Counter, expected: dict[tuple[int, ...], float], alpha: float) -> bool:
    """Whether `runs` could come from `expected`: no impossible run, and a chi-square p-value
    above `alpha`."""
    if not set(runs) <= set(expected):
        return False
    keys = sorted(expected)
    observed = [runs[key] for key in keys]
    return chisquare(observed, [expected[key] * DRAWS for key in keys]).pvalue > alpha


def _accept_all(drafts: Sequence[int], targets: Sequence[int]) -> int:
    return len(drafts)


@pytest.mark.parametrize(
    ("params", "p"),
    [
        (SamplingParams(temperature=1.0), P),
        # top_k=2 keeps each row's two likeliest tokens, renormalized.
        (
            SamplingParams(temperature=1.0, top_k=2),
            np.array(
                [[0.5 / 0.8, 0.3 / 0.8, 0], [0.3 / 0.8, 0.5 / 0.8, 0], [0, 0.3 / 0.8, 0.5 / 0.8]]
            ),
        ),
    ],
)
def test_kept_tokens_follow_the_target_distribution(sampler, params, p):
    runs = _kept_runs(sampler, params)
    assert _fits(runs, {key: prob for key, prob in _expected(p).items() if prob > 0}, 1e-3)


@pytest.mark.parametrize(
    ("verify", "histories"), [(_accept_all, HISTORIES), (num_accepted, ((),) * 3)]
)
def test_a_wrong_verification_fails_the_same_statistic(sampler, verify, histories):
    runs = _kept_runs(sampler, SamplingParams(temperature=1.0), verify, histories)
    assert not _fits(runs, _expected(P), 1e-9)
