"""bench.speculative's bound (the copy search and the shortest path, against brute force) and
its replay of jserve's scheduler on recorded outputs (against the bound)."""

from __future__ import annotations

import array
import functools
import json
import random
from types import SimpleNamespace

import pytest

from bench.speculative import fastest_seconds, longest_copy, replayed_seconds, target_needs
from jserve.config.scheduler import CacheConfig, SchedulerConfig
from jserve.core.step_costs import StepCosts


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


TOKENS, SEQS = (1, 2, 4, 8, 16, 32, 64), (1, 2, 4, 8)
STEP = [0.010, 0.011, 0.013, 0.015, 0.019]  # d = 0..4 drafts: each a little dearer
BETWEEN = 0.001


def _replay(method: str | None, prompt: list[int], out: list[int]) -> float:
    spec = method and json.dumps({"method": method, "num_speculative_tokens": 4})
    config = SchedulerConfig(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256, speculative_config=spec
    )
    engine = SimpleNamespace(  # what the replay reads of an engine
        scheduler=SimpleNamespace(
            step_costs=StepCosts(TOKENS, SEQS), cache_config=CacheConfig(16, 64)
        )
    )
    return replayed_seconds(engine, config, prompt, out, STEP, BETWEEN)


def test_a_replay_without_speculation_takes_one_decode_a_token():
    out = [5, 6, 7, 8, 9]
    assert _replay(None, [1, 2, 3], out) == pytest.approx(4 * (STEP[0] + BETWEEN))


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_replay_never_beats_the_bound_and_gains_on_a_copy(method):
    """The replayed scheduler drafts only copies from the text so far, so it cannot be faster
    than the bound's drafter, which also knows which copy is right; on random text it loses
    little, and copying a repeated pattern it gains."""
    costs = [s + BETWEEN for s in STEP]
    rng = random.Random(2)
    for _ in range(40):
        prompt = [rng.randrange(4) for _ in range(rng.randrange(1, 20))]
        out = [rng.randrange(4) for _ in range(rng.randrange(2, 40))]
        bound = fastest_seconds(_as_bytes(prompt), out, costs)
        assert _replay(method, prompt, out) >= bound - 1e-12, (prompt, out)
    pattern = [10, 11, 12, 13, 14, 15]
    prompt, out = pattern * 4, pattern * 8
    off = (len(out) - 1) * costs[0]
    replay = _replay(method, prompt, out)
    assert fastest_seconds(_as_bytes(prompt), out, costs) <= replay < off / 2


def test_target_needs_match_their_closed_forms():
    """Costs 1.0 (a decode), 1.2 and 1.4 (verifying 1 and 2 drafts), a 0.1 head, target 1.5:
    the accepted drafts needed are target * cost - 1, and for two drafts the acceptance a
    solves a + a^2 = needed, a = (sqrt(1 + 4 needed) - 1) / 2."""
    one, two = target_needs([1.0, 1.2, 1.4], 0.1, 1.5)
    assert one["copy"]["full_acceptance_speedup"] == pytest.approx(2 / 1.2)
    assert one["copy"]["accepted_drafts_needed"] == pytest.approx(0.8)
    assert one["copy"]["per_token_acceptance_needed"] == pytest.approx(0.8)
    assert one["model"]["accepted_drafts_needed"] == pytest.approx(1.5 * 1.3 - 1)
    assert two["copy"]["full_acceptance_speedup"] == pytest.approx(3 / 1.4)
    assert two["copy"]["per_token_acceptance_needed"] == pytest.approx((5.4**0.5 - 1) / 2)
    assert two["model"]["full_acceptance_speedup"] == pytest.approx(3 / 1.6)
    assert two["model"]["per_token_acceptance_needed"] == pytest.approx((6.6**0.5 - 1) / 2)
    # A target past full acceptance needs more accepted drafts than were drafted.
    (cell,) = target_needs([1.0, 1.2], 0.0, 1.8)
    assert cell["copy"]["accepted_drafts_needed"] > 1
    assert cell["copy"]["per_token_acceptance_needed"] is None
