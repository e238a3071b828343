"""Speculative decoding's pure-Python half: the n-gram proposer against a naive reference, its
settings, and the scheduler's drafts: within budget, logit rows and blocks, rolled back when
rejected, hashed only once accepted, stopped at the right token."""

from __future__ import annotations

import dataclasses
import itertools
import json
from array import array

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.config.engine_args import EngineArgs
from jserve.config.scheduler import SchedulerConfig
from jserve.config.settings import InvalidSetting
from jserve.core.ngram import ACCEPTANCE_WEIGHT, note_acceptance, propose_ngram
from jserve.core.request import Request
from jserve.core.stopping import StopConditions
from tests.core.helpers import EOS, free_block_ids, make_request, make_scheduler, tracked

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})


def naive_ngram(tokens: list[int], k: int, min_n: int, max_n: int) -> tuple[list[int], int]:
    """The longest n in [min_n, max_n] whose last-n-gram occurs earlier (ending before the
    last token); its latest occurrence's next k tokens, and n."""
    for n in range(max_n, min_n - 1, -1):
        if n >= len(tokens):
            continue
        suffix = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start : start + n] == suffix:
                return tokens[start + n : start + n + k], n
    return [], 0


@given(
    st.lists(st.integers(0, 3), max_size=40)
    | st.lists(st.sampled_from([0, 1 << 8, 1 << 16, 255, -1, 2**40]), max_size=40),
    st.integers(1, 5),
    st.integers(1, 4),
    st.integers(0, 3),
)
def test_proposer_matches_the_naive_reference(tokens, k, min_n, extra):
    """Small alphabets force many matches; tokens sharing bytes (256, 65536, 255, -1) force
    byte hits off a token boundary, which must be skipped."""
    max_n = min_n + extra
    got = propose_ngram(array("q", tokens), k, min_n, max_n)
    assert (list(got.tokens), got.matched) == naive_ngram(tokens, k, min_n, max_n)


def test_proposer_prefers_the_longest_then_the_latest_match():
    tokens = [5, 6, 7, 1, 5, 6, 8, 2, 9, 6, 3, 5, 6]
    # [5, 6] occurs at 0 (then 7) and 4 (then 8): the latest wins.
    draft = propose_ngram(array("q", tokens), 2, 1, 2)
    assert (list(draft.tokens), draft.matched) == ([8, 2], 2)
    # With 3-grams allowed, [3, 5, 6] has no earlier match: still the 2-gram.
    draft = propose_ngram(array("q", tokens), 2, 1, 3)
    assert (list(draft.tokens), draft.matched) == ([8, 2], 2)
    assert list(propose_ngram(array("q", tokens), 2, 3, 3).tokens) == []


NGRAM = {"method": "ngram"}


@pytest.mark.parametrize(
    ("config", "param"),
    [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 2}, "method"),
        ({**NGRAM, "k": 2}, "k"),
        ({**NGRAM, "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({**NGRAM, "num_speculative_tokens": 17}, "num_speculative_tokens"),
        ({**NGRAM, "prompt_lookup_min": 3, "prompt_lookup_max": 2}, "prompt_lookup_min"),
        ({**NGRAM, "prompt_lookup_max": True}, "prompt_lookup_max"),
        ([1, 2], None),
    ],
)
def test_a_bad_speculative_config_is_refused_naming_it(config, param):
    with pytest.raises(InvalidSetting) as excinfo:
        EngineArgs(speculative_config=json.dumps(config))
    name = "speculative_config" + (f".{param}" if param else "")
    assert excinfo.value.name == name
    assert (param or "JSON object") in str(excinfo.value)
    with pytest.raises(InvalidSetting):
        SchedulerConfig(speculative_config="{not json")


def test_engine_args_take_vllms_json():
    args = EngineArgs(speculative_config=SPEC)
    spec = args.scheduler_config(512).speculative
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 4, 3)
    assert spec.prompt_lookup_min == 1


def test_async_scheduling_and_speculation_are_refused_together():
    """A plan made before the last step's drafts are verified would build on drafts that may
    be rolled back: the two settings are refused together, each alone is served."""
    with pytest.raises(ValueError, match=r"async_scheduling .* speculative_config"):
        EngineArgs(speculative_config=SPEC, async_scheduling=True)
    assert EngineArgs(async_scheduling=True).async_scheduling
    assert EngineArgs(speculative_config=SPEC).speculative_config == SPEC


def _repetitive_request(request_id: str = "r", max_tokens: int = 20, base: int = 0) -> Request:
    """Prompt 1 2 3 4 5 1 2 3 4 5 1 2 (plus `base`): once 3 follows, the lookup of its last
    3-gram [1, 2, 3] proposes 4 5 1 2."""
    stop = StopConditions(max_tokens, 0, frozenset({EOS}))
    prompt = [base + t for t in [1, 2, 3, 4, 5] * 2 + [1, 2]]
    return Request(request_id, prompt, stop=stop, arrival_time=0.0, can_speculate=True)


def _decode_plan(scheduler, request_id="r"):
    """Prefill `request_id` (sampling 3, the lookup's own guess), then plan its first decode."""
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {request_id: 3})
    return scheduler.schedule(0.0)


def test_a_decode_carries_drafts_and_keeps_the_accepted_ones():
    scheduler = make_scheduler(speculative_config=SPEC)
    scheduler.add_request(_repetitive_request())
    plan = _decode_plan(scheduler)
    (seq,) = plan.seqs
    assert (seq.start_pos, list(seq.token_ids), seq.num_drafts) == (12, [3, 4, 5, 1, 2], 4)
    assert plan.num_drafts == 4 and plan.num_batched_tokens == 5
    request = tracked(scheduler, "r")
    assert len(request.block_ids) == 5  # 17 slots in blocks of 4
    # Two drafts accepted (4, 5), then the target's own token 9.
    assert scheduler.update_from_output(plan, {"r": 9}, {"r": 2}) == []
    assert list(request.output_token_ids) == [3, 4, 5, 9]
    assert request.num_computed_tokens == 15  # the decode token and two accepted drafts
    assert request.num_tokens == 16
    assert len(request.block_ids) == 4  # the rejected drafts' last block is free again
    # Only accepted tokens are hashed: 12 known tokens at planning, 15 computed now.
    assert request.num_hashed_blocks == 3
    plan = scheduler.schedule(0.0)
    assert plan.seqs[0].start_pos == 15
    assert request.num_hashed_blocks == 4  # block 3 (3 4 5 9) is complete once this step ran


def test_rejected_drafts_free_their_blocks_and_the_pool_balances():
    scheduler = make_scheduler(num_blocks=16, max_model_len=60, speculative_config=SPEC)
    scheduler.add_request(_repetitive_request(max_tokens=40))
    manager = scheduler.block_manager
    for _ in range(100):
        plan = scheduler.schedule(0.0)
        if not plan.seqs:
            break
        accepted = {s.request_id: 0 for s in plan.seqs if s.num_drafts}
        scheduler.update_from_output(plan, {s.request_id: 6 for s in plan.seqs}, accepted)
        request = tracked(scheduler, "r")
        if request is None:
            break
        assert len(request.block_ids) <= -(-request.num_tokens // 4)  # none past the tokens
        held = set(request.block_ids)
        assert held.isdisjoint(free_block_ids(manager))
        assert len(held) + len(free_block_ids(manager)) == 15
    assert not scheduler.has_unfinished_requests()
    assert len(free_block_ids(manager)) == 15


@pytest.mark.parametrize(
    ("max_tokens", "accepted", "kept", "reason"),
    [(3, 1, [3, 4, 6], "length"), (20, 3, [3, 4, 5, EOS], "stop")],
)
def test_a_stop_inside_an_accepted_run_ends_the_sequence_there(max_tokens, accepted, kept, reason):
    scheduler = make_scheduler(speculative_config=SPEC)
    scheduler.add_request(_repetitive_request(max_tokens=max_tokens))
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {"r": 3})
    request = tracked(scheduler, "r")
    plan = scheduler.schedule(0.0)
    if reason == "stop":
        plan.seqs[0].token_ids[3] = EOS  # as if the lookup had proposed 4 5 EOS 2
    else:  # max_tokens=3 leaves room for one draft (the last token is the target's)
        assert plan.seqs[0].num_drafts == 1
    finished = scheduler.update_from_output(plan, {"r": 6}, {"r": accepted})
    assert finished == [request]
    assert list(request.output_token_ids) == kept
    assert request.finish_reason == reason
    assert len(free_block_ids(scheduler.block_manager)) == 63


def _two_decodes(**config):
    scheduler = make_scheduler(speculative_config=SPEC, **config)
    scheduler.add_request(_repetitive_request("a"))
    scheduler.add_request(_repetitive_request("b", base=10))
    plan = scheduler.schedule(0.0)
    assert [s.num_tokens for s in plan.seqs] == [12, 12]
    scheduler.update_from_output(plan, {"a": 3, "b": 13})
    return scheduler


def test_drafts_respect_the_token_budget_and_logit_rows():
    # Budget 8: two decodes take 2, the first one's drafts 4, the second's the last 2.
    scheduler = _two_decodes()
    scheduler.reconfigure(dataclasses.replace(scheduler.config, max_num_batched_tokens=8))
    plan = scheduler.schedule(0.0)
    assert [s.num_drafts for s in plan.seqs] == [4, 2]
    assert plan.num_batched_tokens == 8 and plan.num_drafts == 6
    # One logit row per draft, within max_num_seqs: 3 rows, two decodes -> one draft.
    plan = _two_decodes(max_num_seqs=3).schedule(0.0)
    assert [s.num_drafts for s in plan.seqs] == [1, 0]


def test_no_drafts_for_requests_that_may_not_speculate_or_without_the_setting():
    for config, can_speculate in ((SPEC, False), (None, True)):
        scheduler = make_scheduler(speculative_config=config)
        request = _repetitive_request()
        request.can_speculate = can_speculate
        scheduler.add_request(request)
        plan = _decode_plan(scheduler)
        assert [s.num_drafts for s in plan.seqs] == [0] and plan.num_drafts == 0


def test_drafts_never_take_blocks_under_the_watermark():
    # 12 usable blocks of 4, the watermark keeps 3 free. After the prefill of "r" (12 tokens)
    # and of a request that may not speculate (16), their decode tokens hold 4 + 5 blocks, so
    # r's drafts get only the 3 other slots of its decode token's block.
    scheduler = make_scheduler(
        num_blocks=13, max_model_len=32, free_block_watermark=0.25, speculative_config=SPEC
    )
    scheduler.add_request(_repetitive_request())
    scheduler.add_request(make_request("b", 16, first_token=100))
    plan = scheduler.schedule(0.0)
    scheduler.update_from_output(plan, {"r": 3, "b": 7})
    plan = scheduler.schedule(0.0)
    assert [(s.request_id, s.num_drafts) for s in plan.seqs] == [("r", 3), ("b", 0)]
    assert len(tracked(scheduler, "r").block_ids) == 4
    assert scheduler.block_manager.num_free_blocks == 3


@pytest.mark.parametrize("accept_all", [True, False])
def test_drafts_stop_while_rejected_and_are_tried_again(accept_all):
    """All drafts rejected: a sequence's acceptance average falls below the floor after a few
    verify steps, and it decodes without drafts until the retry steps lift it back."""
    scheduler = make_scheduler(speculative_config=SPEC)
    scheduler.add_request(_repetitive_request(max_tokens=100))
    drafted = []
    for _ in range(15 if accept_all else 60):  # at most 5 and 1 tokens a step: within 100
        plan = scheduler.schedule(0.0)
        (seq,) = plan.seqs
        drafted.append(seq.num_drafts)
        accepted = {"r": seq.num_drafts if accept_all else 0}
        scheduler.update_from_output(plan, {"r": 6}, accepted if seq.num_drafts else None)
    request = tracked(scheduler, "r")
    if accept_all:
        assert request.draft_acceptance == [1.0, 1.0]
        assert all(drafted[2:])  # from the first repeated token on, every decode drafts
        return
    verify_steps = [i for i, k in enumerate(drafted) if k]
    gaps = [b - a for a, b in itertools.pairwise(verify_steps)]
    assert len(verify_steps) < 20 and max(gaps) > 1  # paused...
    assert verify_steps[-1] > 40  # ...and tried again


@pytest.mark.parametrize(
    ("drafts", "accepted", "rate"),
    [(4, 4, 1.0), (4, 2, 2 / 3), (4, 0, 0.0), (1, 0, 0.0), (3, 1, 0.5)],
)
def test_acceptance_counts_the_drafts_verification_reached(drafts, accepted, rate):
    """Verification stops at the first rejected draft: m accepted of d drafts tried m + 1 of
    them (m when all were accepted), so the rate is each draft's given the ones before it."""
    assert note_acceptance(0.5, drafts, accepted) == pytest.approx(
        0.5 + ACCEPTANCE_WEIGHT * (rate - 0.5)
    )
