"""Speculative decoding's second step, pure Python: the suffix proposer against a brute-force
reference, its tenant histories, and when drafts pay (the step-cost rule, bucket-sized drafts,
`disable_by_batch_size`) down to the scheduler's plans."""

from __future__ import annotations

import dataclasses
import json
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.config.engine_args import EngineArgs
from jserve.config.settings import InvalidSetting
from jserve.core.drafting import RETRY_AFTER, NgramProposer, make_proposer, num_drafts_that_pay
from jserve.core.ngram import COPY, GUESS, RETRY_STEP, note_acceptance
from jserve.core.request import Request
from jserve.core.step_costs import StepCosts
from jserve.core.stopping import StopConditions
from jserve.core.suffix import (
    HISTORY_TOKENS,
    MAX_OCCURRENCES,
    SEPARATOR,
    SuffixProposer,
    suffix_draft,
)
from tests.core.helpers import EOS, make_scheduler

TOKENS = (1, 2, 4, 8, 16, 32, 48, 64)  # engine_buckets(64, 64, decode_midpoints=True)
SEQS = (8, 16, 32, 48, 64)


def naive_suffix(
    context: list[int], source: list[int] | None, k: int, depth: int, factor: float, p_min: float
) -> tuple[list[int], float, int]:
    """The suffix method by brute force over lists (see jserve.core.suffix's docstring): the
    drafts, their score, and the length of the match they continue."""
    own = source is None
    src = context if own else source
    longest = min(depth, len(context) - 1 if own else len(context))
    afters: list[int] = []
    for m in range(longest, 0, -1):
        pattern = context[len(context) - m :]
        afters = [
            p + m
            for p in range(len(src) - m - 1, -1, -1)
            if src[p : p + m] == pattern and src[p + m] != SEPARATOR
        ]
        if afters:
            break
    else:
        return [], 0.0, 0
    afters = afters[:MAX_OCCURRENCES]
    drafts: list[int] = []
    prob, score = 1.0, 0.0
    while len(drafts) < min(k, int(factor * m)):
        nexts = [src[q] if q < len(src) else None for q in afters]
        candidates = [t for t in nexts if t is not None and t != SEPARATOR]
        if not candidates:
            break
        best = max(set(candidates), key=lambda t: (candidates.count(t), -nexts.index(t)))
        prob *= candidates.count(best) / len(afters)
        if prob < p_min:
            break
        drafts.append(best)
        score += prob
        afters = [q + 1 for q in afters if q < len(src) and src[q] == best]
    return drafts, score, m


# Small alphabets force many matches; tokens sharing bytes force byte hits off a token boundary.
ALPHABET = st.sampled_from([0, 1, 2]) | st.sampled_from([0, 1 << 8, 1 << 16, 255, 2**40])
SETTINGS = (st.integers(1, 6), st.integers(1, 8), st.sampled_from([0.5, 1.0, 2.0]))
PROBS = st.sampled_from([0.0, 0.1, 0.4, 0.7])


@given(st.lists(ALPHABET, max_size=40), *SETTINGS, PROBS)
def test_own_tokens_match_the_reference(context, k, depth, factor, p_min):
    got = suffix_draft(array("q", context), None, k, depth, factor, p_min)
    tokens, score, matched = naive_suffix(context, None, k, depth, factor, p_min)
    assert list(got.tokens) == tokens
    assert got.score == pytest.approx(score)
    assert not tokens or got.matched == matched


@given(
    st.lists(ALPHABET, min_size=1, max_size=12),
    st.lists(st.lists(ALPHABET, max_size=12), min_size=1, max_size=4),
    *SETTINGS,
    PROBS,
)
def test_a_history_of_outputs_matches_the_reference(context, outputs, k, depth, factor, p_min):
    history = [t for output in outputs for t in (*output, SEPARATOR)]
    got = suffix_draft(array("q", context), array("q", history), k, depth, factor, p_min)
    tokens, score, matched = naive_suffix(context, history, k, depth, factor, p_min)
    assert list(got.tokens) == tokens
    assert got.score == pytest.approx(score)
    assert not tokens or got.matched == matched


def test_the_most_frequent_continuation_wins_and_short_matches_draft_little():
    # [7, 8] was followed by 1 2 3 twice and by 1 9 once: 1 (3/3), then 2 (2/3), then 3.
    context = [7, 8, 1, 2, 3, 5, 7, 8, 1, 9, 6, 7, 8, 1, 2, 3, 6, 7, 8]
    got = suffix_draft(array("q", context), None, 4, 24, 2.0, 0.1)
    assert list(got.tokens) == [1, 2, 3, 6]  # the match is [6, 7, 8]: 3 tokens, factor 2
    assert got.score == pytest.approx(1 + 1 + 1 + 1)
    # Only the 2-token match counts with a depth of 2: frequencies 3/3, 2/3, 2/3 * 2/2, ...
    got = suffix_draft(array("q", context), None, 4, 2, 1.0, 0.1)
    assert list(got.tokens) == [1, 2]  # at most factor * 2 drafts
    # A floor above 2/3 stops after the certain 1.
    assert list(suffix_draft(array("q", context), None, 4, 2, 1.0, 0.7).tokens) == [1]


def _request(tokens: list[int], tenant: str = "t") -> Request:
    stop = StopConditions(50, 0, frozenset({EOS}))
    return Request("r", tokens, stop=stop, arrival_time=0.0, tenant=tenant, can_speculate=True)


def _finished(output: list[int], tenant: str = "t") -> Request:
    request = _request([99], tenant)
    request.output_token_ids.extend(output)
    return request


def test_suffix_drafts_from_its_tenants_recent_outputs_only():
    proposer = SuffixProposer(24, 2, 1.0, 0.1)
    proposer.on_finish(_finished([10, 11, 12, 13, 14, 15]))
    asking = _request([50, 10, 11, 12])
    draft = proposer.propose(asking, 4)
    assert list(draft.tokens) == [13, 14, 15]  # 3-token match: 3 drafts, a copy
    assert (draft.matched, draft.kind) == (3, COPY)
    assert list(proposer.propose(_request([50, 10, 11, 12], tenant="u"), 4).tokens) == []
    # Two outputs kept: a third drops the oldest.
    proposer.on_finish(_finished([20, 21]))
    proposer.on_finish(_finished([30, 31]))
    assert list(proposer.propose(asking, 4).tokens) == []
    draft = proposer.propose(_request([5, 20]), 4)
    assert (list(draft.tokens), draft.matched, draft.kind) == ([21], 1, GUESS)


def test_a_tenants_history_stays_within_its_token_bound():
    proposer = SuffixProposer(24, 10_000, 1.0, 0.1)
    for i in range(3):
        proposer.on_finish(_finished([i] * (HISTORY_TOKENS // 2)))
    history = proposer._histories["t"]
    assert len(history.tokens) <= HISTORY_TOKENS
    assert list(history.tokens[-2:]) == [2, SEPARATOR]


def test_the_config_makes_the_method_asked_for():
    spec = EngineArgs(
        speculative_config=json.dumps(
            {"method": "suffix", "suffix_decoding_max_spec_factor": 2, "disable_by_batch_size": 4}
        )
    ).scheduler_config(512)
    proposer = make_proposer(spec.speculative)
    assert isinstance(proposer, SuffixProposer) and proposer.max_spec_factor == 2.0
    assert spec.speculative.disable_by_batch_size == 4
    ngram = EngineArgs(speculative_config='{"method": "ngram"}').scheduler_config(512)
    assert isinstance(make_proposer(ngram.speculative), NgramProposer)


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("suffix_decoding_max_spec_factor", 0),
        ("suffix_decoding_min_token_prob", 1.5),
        ("suffix_decoding_max_tree_depth", 0),
        ("suffix_decoding_max_cached_requests", -1),
        ("disable_by_batch_size", 0),
    ],
)
def test_a_suffix_setting_out_of_range_is_refused_naming_it(key, value):
    with pytest.raises(InvalidSetting) as excinfo:
        EngineArgs(speculative_config=json.dumps({"method": "suffix", key: value}))
    assert excinfo.value.name == f"speculative_config.{key}"


# ---- when drafts pay ---------------------------------------------------------------------------


def _costs(seconds: dict[tuple[int, int], float]) -> StepCosts:
    """A table that served each bucket once, taking `seconds`."""
    costs = StepCosts(TOKENS, SEQS)
    for (tokens, seqs), secs in seconds.items():
        costs.observe(tokens, seqs, secs)
    return costs


BATCH_ONE = {(1, 1): 1.0, (2, 2): 1.1, (4, 4): 1.2, (8, 8): 2.0}


@pytest.mark.parametrize(
    ("acceptance", "expected"),
    [
        (1.0, 3),  # 4 tokens fill bucket 4; a fourth draft would pay for bucket 8
        (0.5, 3),  # 1 + 0.5 + 0.25 + 0.125 tokens for 1.2x the time...
        (0.3, 1),  # ...but 1.3 for 1.1x beats 1 + 0.3 + 0.09 + 0.027 for 1.2x...
        (0.1, 0),  # ...and 1.1 for 1.1x gains nothing
    ],
)
def test_a_lone_decode_takes_the_drafts_that_raise_its_tokens_per_second(acceptance, expected):
    assert num_drafts_that_pay(_costs(BATCH_ONE), 1, 1, acceptance, 4) == expected


def test_where_steps_cost_by_token_drafts_stop_paying():
    """32 decodes in a step whose cost grows with its padded tokens: even drafts accepted
    90% of the time do not pay for the next bucket."""
    costs = _costs({(32, 32): 32.0, (48, 48): 48.0})
    assert num_drafts_that_pay(costs, 32, 32, 0.9, 4) == 0
    # Where the step is bound by reading weights (the same cost), every draft pays.
    costs = _costs({(32, 32): 1.0, (48, 48): 1.02})
    assert num_drafts_that_pay(costs, 32, 32, 0.6, 4) == 4


def test_unmeasured_buckets_are_tried_and_no_table_takes_every_draft():
    assert num_drafts_that_pay(_costs({(1, 1): 1.0}), 1, 1, 0.5, 4) == 4
    assert num_drafts_that_pay(None, 1, 1, 0.5, 4) == 4
    assert num_drafts_that_pay(_costs({}), 1, 1, 0.5, 4) == 4
    # A seeded table (a report, not served here) is tried before it is believed.
    assert num_drafts_that_pay(StepCosts(TOKENS, SEQS, BATCH_ONE), 1, 1, 0.05, 4) == 4


def test_a_bucket_priced_too_high_is_tried_again_and_believed_at_its_best():
    """A first run's one-off costs must not keep a bucket out of use for good: after
    RETRY_AFTER steps without it, it is tried again, and its latest time, if lower than its
    average, is what it costs."""
    costs = _costs({**BATCH_ONE, (4, 4): 5.0})  # a slow first run of bucket 4
    assert num_drafts_that_pay(costs, 1, 1, 1.0, 4) == 4  # bucket 8 (5 tokens for 2.0)
    for _ in range(RETRY_AFTER):
        costs.observe(1, 1, 1.0)
        costs.observe(5, 5, 2.0)
    assert num_drafts_that_pay(costs, 1, 1, 1.0, 4) == 3  # bucket 4 is tried again...
    costs.observe(4, 4, 1.2)  # ...and runs in 1.2 (its average is still 4.24)
    assert costs.seconds[(4, 4)] > 4
    assert num_drafts_that_pay(costs, 1, 1, 1.0, 4) == 3  # 4 tokens for 1.2 beat 5 for 2.0


SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}


def _decoding(scheduler, n: int) -> None:
    """Add `n` requests whose prompts repeat (drafts will be proposed) and prefill them."""
    for i in range(n):
        prompt = [100 * i + t for t in [1, 2, 3, 4, 5] * 2 + [1, 2]]
        scheduler.add_request(
            Request(f"r{i}", prompt, stop=StopConditions(20, 0, frozenset({EOS})),
                    arrival_time=0.0, can_speculate=True)
        )  # fmt: skip
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {f"r{i}": 100 * i + 3 for i in range(n)})


def test_the_scheduler_drafts_only_what_the_measured_costs_pay_for():
    costs = _costs(BATCH_ONE)
    scheduler = make_scheduler(speculative_config=json.dumps(SPEC), step_costs=costs)
    _decoding(scheduler, 1)
    (seq,) = scheduler.schedule(0.0).seqs
    assert seq.num_drafts == 3  # bucket 4, not 8


@pytest.mark.parametrize(
    ("seconds", "drafts_at_low_acceptance"),
    [
        ({(1, 1): 1.0, (2, 2): 1.01, (4, 4): 1.02, (8, 8): 1.04}, 3),  # bound by weights
        ({(1, 1): 1.0, (2, 2): 1.5, (4, 4): 2.5, (8, 8): 4.5}, 0),  # cost grows with tokens
    ],
)
def test_with_measured_costs_acceptance_is_priced_not_floored(seconds, drafts_at_low_acceptance):
    """A sequence whose drafts are rarely accepted (0.2, under the floor that stands in when
    no costs are measured) keeps drafting where extra rows cost next to nothing, and where
    they cost what they compute it stops and its acceptance drifts up to try again later."""
    scheduler = make_scheduler(speculative_config=json.dumps(SPEC), step_costs=_costs(seconds))
    _decoding(scheduler, 1)
    (request,) = scheduler.running
    request.draft_acceptance = [0.2, 0.2]
    (seq,) = scheduler.schedule(0.0).seqs
    assert seq.num_drafts == drafts_at_low_acceptance
    # The drafts are a copy (a 3-gram of the prompt): only the copies' average moves.
    bumped = 0.2 if drafts_at_low_acceptance else 0.2 + RETRY_STEP
    assert request.draft_acceptance == [0.2, bumped]


@pytest.mark.parametrize(("acceptance", "drafts"), [([0.0, 1.0], 3), ([1.0, 0.0], 0)])
def test_copies_and_guesses_are_priced_by_their_own_acceptance(acceptance, drafts):
    """A sequence whose guesses (one-token matches) keep being rejected still drafts the
    copies (longer matches) that come up, and accepted guesses buy no room for copies; a
    verify step moves only the average of its drafts' kind."""
    costs = _costs({(1, 1): 1.0, (2, 2): 1.5, (4, 4): 2.5, (8, 8): 4.5})  # grows with tokens
    scheduler = make_scheduler(speculative_config=json.dumps(SPEC), step_costs=costs)
    _decoding(scheduler, 1)  # its drafts continue a 3-gram of its prompt: a copy
    (request,) = scheduler.running
    request.draft_acceptance = list(acceptance)
    plan = scheduler.schedule(0.0)
    (seq,) = plan.seqs
    assert seq.num_drafts == drafts
    if drafts:
        scheduler.update_from_output(plan, {"r0": 7}, {"r0": 1})
        assert request.draft_acceptance == [0.0, note_acceptance(1.0, drafts, 1)]


@pytest.mark.parametrize(("limit", "drafts"), [(None, [4, 4]), (3, [4, 4]), (2, [0, 0])])
def test_disable_by_batch_size_turns_drafts_off_at_that_many_running(limit, drafts):
    spec = {**SPEC, "disable_by_batch_size": limit} if limit else SPEC
    scheduler = make_scheduler(speculative_config=json.dumps(spec), max_num_seqs=16)
    _decoding(scheduler, 2)
    assert [s.num_drafts for s in scheduler.schedule(0.0).seqs] == drafts


def test_a_suffix_scheduler_drafts_from_a_finished_request_of_the_tenant():
    spec = {"method": "suffix", "num_speculative_tokens": 4}
    scheduler = make_scheduler(speculative_config=json.dumps(spec))
    scheduler.add_request(_request([1, 2, 3]))
    for token in [40, 41, 42, 43, 44, 45, EOS]:  # finishes on EOS
        plan = scheduler.schedule(0.0)
        scheduler.update_from_output(plan, {"r": token})
    assert not scheduler.has_unfinished_requests()
    later = _request([7, 40, 41, 42])
    later.request_id = "s"
    scheduler.add_request(later)
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {"s": 43})
    (seq,) = scheduler.schedule(0.0).seqs
    assert list(seq.token_ids[1:]) == [44, 45, EOS]  # match [40 .. 43]: up to 4 drafts


def test_the_proposer_outlives_speculation_switched_off_and_on():
    spec = json.dumps({"method": "suffix"})
    scheduler = make_scheduler(speculative_config=spec)
    proposer = scheduler.proposer
    config = scheduler.config
    scheduler.reconfigure(dataclasses.replace(config, speculative_config=None))
    scheduler.reconfigure(config)
    assert scheduler.proposer is proposer  # its tenants' histories are kept
    scheduler.reconfigure(dataclasses.replace(config, speculative_config=json.dumps(SPEC)))
    assert isinstance(scheduler.proposer, NgramProposer)
    assert scheduler.fresh().proposer is not scheduler.proposer  # a fresh one starts empty
