"""Shape buckets: powers of two up to the budget, the budget always last; bisect picks."""

from __future__ import annotations

import pytest

from jserve.core.buckets import (
    engine_buckets,
    make_seq_buckets,
    make_token_buckets,
    pick_bucket,
    pick_step_bucket,
    step_buckets,
)


def test_token_buckets():
    assert make_token_buckets(512) == (16, 32, 64, 128, 256, 512)
    assert make_token_buckets(384) == (16, 32, 64, 128, 256, 384)
    assert make_token_buckets(16) == (16,)
    assert make_token_buckets(10) == (10,)


def test_seq_buckets():
    assert make_seq_buckets(32) == (8, 16, 32)
    assert make_seq_buckets(48) == (8, 16, 32, 48)
    assert make_seq_buckets(4) == (4,)
    assert make_seq_buckets(5, smallest=1) == (1, 2, 4, 5)


def test_pick_bucket():
    buckets = make_token_buckets(384)
    assert [pick_bucket(buckets, n) for n in (0, 1, 16, 17, 256, 257, 384)] == [
        16,
        16,
        16,
        32,
        256,
        384,
        384,
    ]
    with pytest.raises(ValueError, match="385 does not fit the largest bucket 384"):
        pick_bucket(buckets, 385)


def test_bad_bounds():
    with pytest.raises(ValueError, match="bucket bounds must be >= 1, got smallest=16, largest=0"):
        make_token_buckets(0)


def test_engine_buckets_add_midpoints_in_the_decode_range_only():
    assert engine_buckets(512, 64, decode_midpoints=True) == (
        (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512),
        (8, 16, 24, 32, 48, 64),
    )
    assert engine_buckets(512, 40, decode_midpoints=True) == (
        (1, 2, 4, 8, 16, 24, 32, 64, 128, 256, 512),
        (8, 16, 24, 32, 40),
    )
    assert engine_buckets(512, 64, decode_midpoints=False) == (
        make_token_buckets(512, smallest=1),
        make_seq_buckets(64),
    )


@pytest.mark.parametrize("midpoints", [False, True])
@pytest.mark.parametrize("max_tokens,max_seqs", [(512, 32), (64, 8), (256, 1), (100, 48), (96, 96)])
def test_every_step_shape_is_precompiled_and_holds_the_step(max_tokens, max_seqs, midpoints):
    tokens, seqs = engine_buckets(max_tokens, max_seqs, midpoints)
    precompiled = set(step_buckets(tokens, seqs))
    for n_tokens in range(1, max_tokens + 1):
        for n_seqs in range(1, min(n_tokens, max_seqs) + 1):
            t, s = pick_step_bucket(tokens, seqs, n_tokens, n_seqs)
            assert (t, s) in precompiled
            assert t >= n_tokens and s >= n_seqs


def test_a_lone_decode_computes_one_row():
    assert pick_step_bucket(make_token_buckets(512, smallest=1), (8, 16, 32), 1, 1) == (1, 1)
