"""Padded shape buckets, shared by the scheduler's caller and the runtime's precompile step.

Every step is padded up to one bucket, so the runtime compiles once per bucket and never in
the serving loop. Powers of two bound padding waste to under half a step. In the decode range
(up to max_num_seqs) `engine_buckets` can also add the midpoints 24, 48, 96, ...: a decode
step has one token per running sequence, a count that drifts through every value as requests
finish, and from about 16 tokens on a CPU step costs in proportion to its padded tokens, so
there the midpoints cut the waste to under a third. Prefill steps fill the budget (the top
bucket), so the range above gets no midpoints and no extra compiles.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

MIDPOINTS_FROM = 16  # the smallest power of two followed by a 1.5x midpoint


def _powers_of_two_up_to(smallest: int, largest: int, midpoints_up_to: int) -> tuple[int, ...]:
    if smallest < 1 or largest < 1:
        raise ValueError(f"bucket bounds must be >= 1, got smallest={smallest}, largest={largest}")
    buckets = []
    size = smallest
    while size < largest:
        buckets.append(size)
        midpoint = size * 3 // 2
        if size >= MIDPOINTS_FROM and midpoint <= midpoints_up_to and midpoint < largest:
            buckets.append(midpoint)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


def make_token_buckets(
    max_num_batched_tokens: int, smallest: int = 16, midpoints_up_to: int = 0
) -> tuple[int, ...]:
    """Token-axis sizes: 16, 32, 64, ... below the budget, then the budget itself; with
    `midpoints_up_to`, also 24, 48, 96, ... up to it."""
    return _powers_of_two_up_to(smallest, max_num_batched_tokens, midpoints_up_to)


def make_seq_buckets(
    max_num_seqs: int, smallest: int = 8, midpoints_up_to: int = 0
) -> tuple[int, ...]:
    """Sequence-axis sizes: 8, 16, 32, ... below `max_num_seqs`, then `max_num_seqs`; with
    `midpoints_up_to`, also 24, 48, 96, ... up to it."""
    return _powers_of_two_up_to(smallest, max_num_seqs, midpoints_up_to)


def engine_buckets(
    max_num_batched_tokens: int, max_num_seqs: int, decode_midpoints: bool
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The engine's (token buckets, seq buckets): token buckets from 1 (a lone decode pays
    for one token) and, with `decode_midpoints` (where a step's cost grows with its tokens, as
    on a CPU; not where decode is bound by reading weights), midpoints in the decode range on
    both axes (see the module docstring)."""
    up_to = max_num_seqs if decode_midpoints else 0
    return (
        make_token_buckets(max_num_batched_tokens, smallest=1, midpoints_up_to=up_to),
        make_seq_buckets(max_num_seqs, midpoints_up_to=up_to),
    )


def pick_bucket(buckets: Sequence[int], n: int) -> int:
    """Smallest bucket holding `n` (sorted `buckets`, as made above)."""
    index = bisect_left(buckets, n)
    if index == len(buckets):
        raise ValueError(
            f"{n} does not fit the largest bucket {buckets[-1]}; the scheduler should never "
            f"plan more than the budget the buckets were made for"
        )
    return buckets[index]


def step_buckets(token_buckets: Sequence[int], seq_buckets: Sequence[int]) -> list[tuple[int, int]]:
    """Every (tokens, seqs) shape `pick_step_bucket` can return: the set to precompile."""
    smallest = seq_buckets[0]
    small = [(t, t) for t in token_buckets if t < smallest]
    return small + [(t, s) for t in token_buckets if t >= smallest for s in seq_buckets if s <= t]


def pick_step_bucket(
    token_buckets: Sequence[int], seq_buckets: Sequence[int], num_tokens: int, num_seqs: int
) -> tuple[int, int]:
    """The padded (tokens, seqs) shape of a step.

    A step smaller than the smallest sequence bucket pads its sequences to its token bucket
    (it has at most that many), so a lone decode computes one row of logits, not eight.
    """
    t = pick_bucket(token_buckets, num_tokens)
    return (t, t) if t < seq_buckets[0] else (t, pick_bucket(seq_buckets, num_seqs))
