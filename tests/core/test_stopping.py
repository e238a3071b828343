"""The stop rules (jserve.core.stopping) on hand-made cases, boundaries included."""

from __future__ import annotations

import json

from jserve.core.stopping import StopConditions, StopDecision
from jserve.outputs import FinishReason
from jserve.sampling_params import SamplingParams

EOS = 2


def test_stop_token_counts_from_min_tokens_inclusive_and_length_at_max_tokens():
    stop = StopConditions.from_params(SamplingParams(min_tokens=2, stop_token_ids=[9]), [EOS], 4)
    assert stop.stop_token_ids == {EOS, 9}
    assert stop.after_token(EOS, 1) is None  # below min_tokens
    assert stop.after_token(EOS, 2) is FinishReason.STOP  # at min_tokens: stops
    assert stop.after_token(9, 3) is FinishReason.STOP
    assert stop.after_token(7, 3) is None
    assert stop.after_token(7, 4) is FinishReason.LENGTH
    assert stop.after_token(9, 4) is FinishReason.STOP  # a stop token wins over the length


def test_ignore_eos_still_bans_eos_below_min_tokens_as_vllm_does():
    params = SamplingParams(min_tokens=2, stop_token_ids=[9, 5], ignore_eos=True)
    stop = StopConditions.from_params(params, [EOS], 16)
    assert stop.after_token(EOS, 5) is None and stop.stop_token_ids == {5, 9}
    assert stop.banned_ids(0) == stop.banned_ids(1) == (EOS, 5, 9)
    assert stop.banned_ids(2) == ()


def test_stop_strings_are_searched_from_min_tokens_on():
    stop = StopConditions.from_params(SamplingParams(min_tokens=3, stop=["ab"]), [], 16)
    below = stop.after_text("xab", 1, 2)
    assert (below.stop, below.end) == (None, 3)  # below min_tokens: all text, nothing held
    at = stop.after_text("xaba", 3, 3)
    assert (at.stop, at.end) == (None, 3)  # "ab" was searched before; the tail "a" is held
    hit = stop.after_text("xabab", 4, 4)
    assert (hit.stop, hit.end) == ("ab", 3)


def test_decide_orders_token_rules_stop_strings_then_a_complete_grammar():
    stop = StopConditions.from_params(SamplingParams(stop=["ab"]), [EOS], 4)
    STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
    assert stop.decide(7, None, None, False) is None
    assert stop.decide(7, None, None, True) == StopDecision(STOP, None)  # only EOS may follow
    assert stop.decide(7, None, "ab", True) == StopDecision(STOP, "ab")  # the string is named
    assert stop.decide(EOS, STOP, "ab", True) == StopDecision(STOP, EOS)  # the stop token wins
    # the length wins over a grammar completed by the last allowed token, as without rule 4
    assert stop.decide(7, LENGTH, None, True) == StopDecision(LENGTH, None)
    assert stop.decide(7, LENGTH, "ab", False) == StopDecision(LENGTH, None)


def test_finish_reasons_are_the_strings_http_bodies_carry():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "timeout", "error"]
    assert json.dumps({"finish_reason": FinishReason.TIMEOUT}) == '{"finish_reason": "timeout"}'
