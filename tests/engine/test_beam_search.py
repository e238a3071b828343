"""Beam search (jserve.engine.beam_search): the search against a naive beam search over full
distributions, and on the real model against the same naive search over transformers'
log-probabilities."""

from __future__ import annotations

import math
import random

import pytest

from jserve.engine.beam_search import BeamSearch, beam_search_offline
from jserve.errors import RejectReason, RequestRejected
from jserve.outputs import CompletionOutput, FinishReason, Logprob
from jserve.sampling_params import BeamSearchParams
from tests.shared_engine import run_to_completion

VOCAB, STOP = 7, 6


def _model(tokens: tuple[int, ...]) -> list[float]:
    """A fixed random next-token distribution per prefix (log-probabilities)."""
    rng = random.Random(hash(tokens))
    logits = [rng.gauss(0.0, 2.0) for _ in range(VOCAB)]
    norm = math.log(sum(math.exp(x) for x in logits))
    return [x - norm for x in logits]


def naive_beam_search(
    prompt, width, max_tokens, penalty, ignore_eos, logprobs_of, stops=frozenset({STOP})
):
    """Beam search by its definition: every live beam's 2 * width likeliest next tokens are
    candidates; those ending in one of `stops` are complete (unless ignore_eos), the best
    `width` others live on; the best `width` of the complete and live are the answer. Score:
    cumulative logprob / (tokens, prompt included, not a final stop token) ** penalty."""

    def score(c):
        tokens, total = c
        return total / (len(tokens) - (tokens[-1] in stops)) ** penalty

    live, complete = [(list(prompt), 0.0)], []
    for _ in range(max_tokens):
        if not live:
            break
        candidates = []
        for tokens, total in live:
            dist = logprobs_of(tokens)
            for t in sorted(range(len(dist)), key=lambda t: -dist[t])[: 2 * width]:
                candidates.append(([*tokens, t], total + dist[t]))
        complete += [c for c in candidates if c[0][-1] in stops and not ignore_eos]
        rest = [c for c in candidates if c[0][-1] not in stops or ignore_eos]
        live = sorted(rest, key=score, reverse=True)[:width]
    return sorted(complete + live, key=score, reverse=True)[:width]


def _step(dist: list[float], width: int) -> CompletionOutput:
    """What the engine returns for a beam's one-token request: the top 2 * width logprobs
    (the greedy token is among them)."""
    top = sorted(range(len(dist)), key=lambda t: -dist[t])[: 2 * width]
    return CompletionOutput(
        0, token_ids=[top[0]], logprobs=[{t: Logprob(dist[t]) for t in top}],
        finish_reason=FinishReason.LENGTH,
    )  # fmt: skip


@pytest.mark.parametrize("width", [1, 2, 3])
@pytest.mark.parametrize("penalty", [0.0, 1.0, 2.5])
@pytest.mark.parametrize("ignore_eos", [False, True])
def test_the_search_is_beam_search(width, penalty, ignore_eos):
    for prompt in ([1], [2, 3], [4, 0, 5]):
        params = BeamSearchParams(width, 6, ignore_eos=ignore_eos, length_penalty=penalty)
        search = BeamSearch(prompt, params, [STOP], 64)
        while not search.done:
            search.advance([_step(_model(tuple(b.tokens)), width) for b in search.live])
        got = search.best(lambda ids, skip_special_tokens=True: str(ids))
        want = naive_beam_search(prompt, width, 6, penalty, ignore_eos, lambda t: _model(tuple(t)))
        assert [b.tokens for b in got] == [w[0] for w in want]
        assert [b.cum_logprob for b in got] == pytest.approx([w[1] for w in want])
        for beam in got:  # the text is the beam's own tokens, less a final stop token
            own = beam.tokens[len(prompt) :]
            stopped = own[-1] == STOP and not ignore_eos
            assert beam.text == str(own[:-1] if stopped else own)
            assert beam.finish_reason == (FinishReason.STOP if stopped else FinishReason.LENGTH)


def test_a_failed_step_ends_the_search_with_its_reason():
    search = BeamSearch([1], BeamSearchParams(2, 5), [STOP], 64)
    search.advance([_step(_model((1,)), 2)])
    timed_out = CompletionOutput(0, finish_reason=FinishReason.TIMEOUT)
    search.advance([timed_out] * len(search.live))
    assert search.done
    beams = search.best(lambda ids, skip_special_tokens=True: "")
    assert {b.finish_reason for b in beams} <= {FinishReason.TIMEOUT, FinishReason.STOP}
    assert all(len(b.tokens) == 2 for b in beams)  # the first step's, kept


@pytest.mark.parametrize(
    ("field", "value"),
    [("beam_width", 0), ("beam_width", 11), ("max_tokens", 0), ("temperature", -1.0),
     ("length_penalty", float("nan")), ("ignore_eos", 1)],
)  # fmt: skip
def test_bad_params_are_refused_naming_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        BeamSearchParams(**{"beam_width": 2, "max_tokens": 4, field: value})


def test_real_model_beams_are_those_of_transformers_log_probabilities(engine, hf_default_model):
    """jserve's beams over SmolLM2 are the naive search's over transformers' float32
    log-probabilities of the same GGUF (an implementation nobody here wrote), every prompt's
    beams served together by the engine."""
    import torch

    tokenizer = engine.tokenizer
    prompts = ["The capital of France is", "1, 2, 3,", "Once upon a time"]
    params = BeamSearchParams(beam_width=3, max_tokens=6)

    def run(ids: list[str]) -> list:
        final = run_to_completion(engine)
        return [final[i] for i in ids]

    got = beam_search_offline(engine, prompts, params, run)

    @torch.no_grad()
    def logprobs_of(tokens: list[int]) -> list[float]:
        logits = hf_default_model(torch.tensor([tokens])).logits[0, -1].double()
        return torch.log_softmax(logits, -1).tolist()

    for prompt, result in zip(prompts, got, strict=True):
        ids = tokenizer.encode(prompt)
        want = naive_beam_search(ids, 3, 6, 1.0, False, logprobs_of, tokenizer.stop_token_ids)
        assert [b.tokens for b in result.sequences] == [w[0] for w in want], prompt
        assert [b.cum_logprob for b in result.sequences] == pytest.approx(
            [w[1] for w in want], abs=1e-3
        )
        assert result.sequences[0].text == tokenizer.decode(want[0][0][len(ids) :])


def test_a_prompt_and_max_tokens_past_max_model_len_are_refused_up_front():
    with pytest.raises(RequestRejected, match="7 tokens exceed max_model_len=6") as caught:
        BeamSearch([1, 2, 3], BeamSearchParams(2, 4), [STOP], 6)
    assert caught.value.reason is RejectReason.TOO_LONG
