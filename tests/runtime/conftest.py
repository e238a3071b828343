"""The sampler the runtime tests share, precompiled once a run, and its sizes."""

from __future__ import annotations

import pytest

from jserve.runtime.sampler import Sampler

# > 64 * TOP_CANDIDATES, so the blocked candidate search runs; not a multiple of 64, nor of 32
# (a grammar bitmask's last word is partly past the vocabulary).
V = 10_000
BUCKETS = (4, 8, 16)
MAX_MODEL_LEN = 64


@pytest.fixture(scope="session")
def sampler() -> Sampler:
    sampler = Sampler(V, BUCKETS, MAX_MODEL_LEN)
    sampler.precompile()
    return sampler
