"""The stop rules (jserve.core.stopping): hand-made cases with their boundaries; stop strings
searched piece by piece against the one-shot search and a direct reference; their cost."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.core.stopping import StopConditions, StopDecision, check_stop_strings
from jserve.outputs import FinishReason
from jserve.sampling_params import (
    MAX_STOP_STRING_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOTAL_LENGTH,
    SamplingParams,
)
from tests.budgets import examples

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


def test_stop_strings_must_end_after_the_first_min_tokens_tokens():
    stop = StopConditions.from_params(SamplingParams(min_tokens=3, stop=["ab"]), [], 16)
    search = stop.stop_string_search()
    steps = [search.add_text(text, n) for text, n in [("x", 1), ("ab", 2), ("a", 3), ("b", 4)]]
    assert [(c.stop, c.end) for c in steps] == [
        (None, 1),
        (None, 3),  # within min_tokens: all text, nothing held
        (None, 4),  # the 3rd token is still within min_tokens (vLLM's rule): "ab" is not sought
        ("ab", 3),  # a stop string may begin within min_tokens and end after it
    ]


def test_samples_share_the_automaton_but_not_their_place_in_it():
    stop = StopConditions.from_params(SamplingParams(n=2, stop=["stop"]), [], 16)
    first, second = stop.stop_string_search(), stop.stop_string_search()
    assert (first.add_text("st", 1).end, second.add_text("xs", 1).end) == (0, 1)
    assert (first.add_text("op", 2).stop, second.add_text("op", 2).stop) == ("stop", None)


@pytest.mark.parametrize(
    ("pieces", "stops", "expected"),
    [
        (["Hello wor", "ld"], ["world", "wor"], [("wor", 6)]),  # starts first wins
        (["abc"], ["abc", "ab"], [("abc", 0)]),  # same start: the first listed
        (["abc"], ["ab", "abc"], [("ab", 0)]),
        (["aXbcdY"], ["bcdY", "cd"], [("bcdY", 2)]),  # ends later, starts first
        (["😀 é", "tëst😀", "!"], ["ëst😀!", "😀é"], [(None, 3), (None, 4), ("ëst😀!", 4)]),
        (["你好", "世", "界"], ["世界"], [(None, 2), (None, 2), ("世界", 2)]),
        (["a", "a", "a", "b"], ["aaab", "ab"], [(None, 0), (None, 0), (None, 0), ("aaab", 0)]),
        (["xa", "", "b"], ["ab"], [(None, 1), (None, 1), ("ab", 1)]),  # a token without text
        (["ab", "c"], ["b", "abc"], [("b", 1)]),
    ],
)
def test_stop_string_search_on_hand_made_cases(pieces, stops, expected):
    search = StopConditions(stop_strings=tuple(stops)).stop_string_search()
    checks = [search.add_text(piece, n) for n, piece in enumerate(pieces[: len(expected)], 1)]
    assert [(c.stop, c.end) for c in checks] == expected


def test_decide_orders_stop_tokens_stop_strings_the_length_then_a_complete_grammar():
    stop = StopConditions.from_params(SamplingParams(stop=["ab"]), [EOS], 4)
    STOP, LENGTH = FinishReason.STOP, FinishReason.LENGTH
    assert stop.decide(7, None, None, False) is None
    assert stop.decide(7, None, None, True) == StopDecision(STOP, None)  # only EOS may follow
    assert stop.decide(7, None, "ab", True) == StopDecision(STOP, "ab")  # the string is named
    assert stop.decide(EOS, STOP, "ab", True) == StopDecision(STOP, None)  # the stop token wins
    # the length wins over a grammar completed by the last allowed token, as without rule 4
    assert stop.decide(7, LENGTH, None, True) == StopDecision(LENGTH, None)
    # a stop string the last allowed token completes wins over the length: the text is cut
    # before it, as vLLM's output processor turns the length finish into a stop
    assert stop.decide(7, LENGTH, "ab", False) == StopDecision(STOP, "ab")


@pytest.mark.parametrize(
    ("params", "token", "stop_reason"),
    [
        (SamplingParams(), EOS, None),  # the model's EOS: None, as vLLM
        (SamplingParams(), 0, None),  # another model stop token (end of turn): None too
        (SamplingParams(stop_token_ids=[9]), 9, 9),  # the user's stop id: the id
        (SamplingParams(stop_token_ids=[EOS]), EOS, None),  # EOS is checked first, as vLLM
        (SamplingParams(stop_token_ids=[EOS], ignore_eos=True), EOS, EOS),  # now only the user's
    ],
)
def test_stop_reason_names_the_users_stop_id_and_never_a_model_stop_token(
    params, token, stop_reason
):
    # Whichever of the model's stop tokens a GGUF or an HF checkpoint declares as EOS, the
    # answer is the same: only the user's stop_token_ids are named.
    stop = StopConditions.from_params(params, [EOS, 0], 16)
    decision = stop.decide(token, stop.after_token(token, 1), None, False)
    assert decision == StopDecision(FinishReason.STOP, stop_reason)


def test_finish_reasons_are_the_strings_http_bodies_carry():
    assert [str(r) for r in FinishReason] == ["stop", "length", "abort", "timeout", "error"]
    assert json.dumps({"finish_reason": FinishReason.TIMEOUT}) == '{"finish_reason": "timeout"}'


@pytest.mark.parametrize(
    ("text", "stops", "search_from", "expected"),
    [
        ("Hello world", ["wor"], 0, ("wor", 6)),
        ("abcSTOPdefEND", ["END", "STOP"], 0, ("STOP", 3)),
        ("abXYcd", ["XY"], 3, ("XY", 2)),  # straddles the already-searched part
        ("Hello wo", ["world"], 0, (None, 6)),  # "wo" may become "world": hold it back
        ("Hello", ["lo!", "xyz"], 0, (None, 3)),
        ("Hello", ["Hello!"], 0, (None, 0)),
        ("Hello", [], 0, (None, 5)),
        ("", ["x"], 0, (None, 0)),
        ("aaa", ["aa"], 0, ("aa", 0)),
    ],
)
def test_check_stop_strings(text, stops, search_from, expected):
    check = check_stop_strings(text, stops, search_from)
    assert (check.stop, check.end) == expected


def test_empty_stop_string_is_refused():
    with pytest.raises(ValueError, match=r"non-empty, got \['a', ''\]"):
        check_stop_strings("text", ["a", ""])
    with pytest.raises(ValueError, match=r"non-empty, got \['a', ''\]"):
        StopConditions(stop_strings=("a", ""))


def first_stop_reference(chunks: list[str], stops: list[str]) -> str:
    """What a stream must emit: generation stops at the first chunk after which the text holds a
    stop string, and the output ends right before the earliest one present then."""
    text = ""
    for chunk in chunks:
        text += chunk
        found = [i for i in (text.find(s) for s in stops) if i != -1]
        if found:
            return text[: min(found)]
    return text


ALPHABET = "ab cé😀"  # few letters, so stop strings overlap and repeat; multi-byte ones too


@examples(400)  # cheap examples: four times the profile's
@given(
    chunks=st.lists(st.text(alphabet=ALPHABET, max_size=5), max_size=10),
    stops=st.lists(st.text(alphabet=ALPHABET, min_size=1, max_size=4), max_size=4),
    min_tokens=st.integers(0, 4),
)
def test_search_answers_as_the_one_shot_check_and_emits_the_text_before_the_first_stop(
    chunks, stops, min_tokens
):
    """Piece by piece, `StopStringSearch` answers exactly as `check_stop_strings` on the whole
    text (up to min_tokens: no stop, nothing held); from min_tokens 0 the emitted text is the
    direct reference's, and what is held back is shorter than the longest stop string."""
    search = StopConditions(min_tokens=min_tokens, stop_strings=tuple(stops)).stop_string_search()
    text, emitted = "", ""
    for n, chunk in enumerate(chunks, 1):
        text += chunk
        check = search.add_text(chunk, n)
        if n > min_tokens:
            expected = check_stop_strings(text, stops, search_from=len(text) - len(chunk))
        else:
            expected = check_stop_strings(text, [], 0)
        assert (check.stop, check.end) == (expected.stop, expected.end)
        emitted = text[: check.end]
        if check.stop is not None:
            break
        assert len(text) - check.end <= max(map(len, stops), default=1) - 1
    else:
        emitted = text  # ended for another reason: everything is released
    if min_tokens == 0:
        assert emitted == first_stop_reference(chunks, stops)


def _seconds_per_piece(search, pieces: list[str], first_token: int) -> float:
    """The least time one piece took, over batches of them (the least is the least disturbed
    by other work on the machine)."""
    batches = [pieces[i : i + 100] for i in range(0, len(pieces), 100)]
    best = float("inf")
    for number, batch in enumerate(batches):
        started = time.perf_counter()
        for k, piece in enumerate(batch):
            search.add_text(piece, first_token + number * 100 + k)
        best = min(best, (time.perf_counter() - started) / len(batch))
    return best


def test_a_piece_costs_the_same_however_long_the_text_and_the_stop_list():
    """Issue case 5: a stop list at the caps, a long text. The strings share beginnings with
    the text, so most pieces move deep into the automaton and the held-back tail is long."""
    stops = [f"{i:03d}" + "ab" * (MAX_STOP_STRING_LENGTH // 2 - 2) + "!" for i in range(3)]
    stops += [f"b{i:03d}" for i in range(MAX_STOP_STRINGS - len(stops))]
    assert sum(map(len, stops)) > MAX_STOP_TOTAL_LENGTH - 16
    capped = StopConditions.from_params(SamplingParams(stop=stops), [], 1 << 30)
    one = StopConditions.from_params(SamplingParams(stop=["!"]), [], 1 << 30)
    # Never a whole stop string ("b" is never followed by a digit), often the start of one.
    pieces = ["ab" * 4, "a", "000", "ab" * 3, "ab", "a001", "ab" * 2] * 200
    short = _seconds_per_piece(capped.stop_string_search(), pieces, 1)
    simple = _seconds_per_piece(one.stop_string_search(), pieces, 1)
    long = capped.stop_string_search()
    for n in range(50):  # 50 x 1200 pieces: over 300,000 characters
        assert long.add_text("".join(pieces), n + 1).stop is None
    late = _seconds_per_piece(long, pieces, 51)
    # Per character it is a few dictionary steps either way; the old per-string search and
    # suffix scans made `capped` cost over 100x `one`. Generous bounds: timing is noisy.
    assert late < 4 * short, (late, short)
    assert short < 4 * simple, (short, simple)
