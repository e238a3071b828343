"""bench.speculative's bound: the copy search and the shortest path, against brute force."""

from __future__ import annotations

import array
import functools
import random

from bench.speculative import fastest_seconds, longest_copy


def _occurs(text: list[int], run: list[int]) -> bool:
    return any(text[j : j + len(run)] == run for j in range(len(text) - len(run) + 1))


def _as_bytes(tokens: list[int]) -> bytes:
    return array.array("q", tokens).tobytes()


def test_longest_copy_matches_a_list_search():
    rng = random.Random(0)
    for _ in range(300):
        text = [rng.randrange(4) for _ in range(rng.randrange(0, 12))]
        out = [rng.randrange(4) for _ in range(rng.randrange(1, 8))]
        i, k = rng.randrange(len(out)), rng.randrange(0, 6)
        expected = 0
        while expected < min(k, len(out) - i) and _occurs(text, out[i : i + expected + 1]):
            expected += 1
        assert longest_copy(_as_bytes(text), array.array("q", out), i, k) == expected


def test_longest_copy_ignores_hits_across_token_boundaries():
    # 256 is bytes 00 01 00..; 1 is 01 00 ..: 1's bytes occur inside 256's, not on a boundary.
    assert longest_copy(_as_bytes([256, 0]), array.array("q", [1]), 0, 4) == 0


def _exhaustive(history: list[int], out: list[int], step: list[float]) -> float:
    """The least time over every choice of d at every step whose drafts are all copies."""

    @functools.cache
    def best(i: int) -> float:
        if i >= len(out):
            return 0.0
        options = []
        for d in range(min(len(step) - 1, len(out) - 1 - i) + 1):
            if d == 0 or _occurs(history + out[:i], out[i : i + d]):
                options.append(step[d] + best(i + 1 + d))
        return min(options)

    return best(1) if len(out) > 1 else 0.0


def test_fastest_seconds_matches_exhaustive_search():
    rng = random.Random(1)
    for _ in range(60):
        history = [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        out = [rng.randrange(3) for _ in range(rng.randrange(1, 9))]
        step = sorted(rng.uniform(1.0, 3.0) for _ in range(rng.randrange(1, 4)))
        got = fastest_seconds(_as_bytes(history), out, step)
        assert abs(got - _exhaustive(history, out, step)) < 1e-9, (history, out, step)
