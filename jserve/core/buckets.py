"""Padded shape buckets, shared by the scheduler's caller and the runtime's precompile step.

Every step is padded up to one bucket, so the runtime compiles once per bucket and never in
the serving loop. Powers of two bound padding waste to under half a step.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence


def _powers_of_two_up_to(smallest: int, largest: int) -> tuple[int, ...]:
    if smallest < 1 or largest < 1:
        raise ValueError(f"bucket bounds must be >= 1, got smallest={smallest}, largest={largest}")
    buckets = []
    size = smallest
    while size < largest:
        buckets.append(size)
        size *= 2
    buckets.append(largest)
    return tuple(buckets)


def make_token_buckets(max_num_batched_tokens: int, smallest: int = 16) -> tuple[int, ...]:
    """Token-axis sizes: 16, 32, 64, ... below the budget, then the budget itself."""
    return _powers_of_two_up_to(smallest, max_num_batched_tokens)


def make_seq_buckets(max_num_seqs: int, smallest: int = 8) -> tuple[int, ...]:
    """Sequence-axis sizes: 8, 16, 32, ... below `max_num_seqs`, then `max_num_seqs`."""
    return _powers_of_two_up_to(smallest, max_num_seqs)


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
