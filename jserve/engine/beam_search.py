"""Beam search (vLLM's `use_beam_search` and `LLM.beam_search`), run on top of the engine.

A search keeps up to `beam_width` live beams (the prompt, then a beam's tokens). Each step asks
the engine for one token of every live beam, as a request of its own whose prompt is the
beam's tokens, with the top 2 * beam_width log-probabilities (plus the step's sampled token's,
at `temperature`); the prefix cache serves the beams' shared prefixes, so a step computes
little more than each beam's last block. Every beam's candidates (its tokens plus one) are
ranked by `cumulative logprob / length ** length_penalty`, the length counting the prompt and
not a final stop token (vLLM's score, after transformers'): a candidate ending in a stop token
is complete (unless `ignore_eos`), the best `beam_width` others stay live. After `max_tokens`
steps, or once no beam is live, the complete and the live beams are ranked together and the
best `beam_width` are the result, best first, as vLLM's beam search does.

`BeamSearch` is the search alone (what to run next, what came back); `beam_search` drives it
through an async engine's `generate` (the server), `beam_search_offline` through the offline
engine (`jserve.engine.llm.LLM.beam_search`), whose steps run every prompt's beams together.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from jserve.core.admission import check_fits
from jserve.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from jserve.sampling_params import BeamSearchParams, SamplingParams

if TYPE_CHECKING:  # the server runs searches too, and imports no JAX
    from jserve.engine.llm_engine import LLMEngine, Prompt


@dataclass
class Beam:
    """One hypothesis (vLLM's BeamSearchSequence): the prompt's tokens then its own, each
    generated token's step candidates, and their cumulative log-probability. `text` and
    `finish_reason` are set on the beams a search returns."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: FinishReason | None = None


@dataclass
class BeamSearchOutput:
    """vLLM's: a prompt's best beams, best first."""

    sequences: list[Beam]


def _child(beam: Beam, token: int, candidates: dict[int, Logprob], cum_logprob: float) -> Beam:
    """`beam` extended by `token`, one of the step's `candidates`."""
    return Beam([*beam.tokens, token], [*beam.logprobs, candidates], cum_logprob)


class BeamSearch:
    """One prompt's search: which beams to extend next (`live`), and what each step gave."""

    def __init__(
        self,
        prompt_ids: Sequence[int],
        params: BeamSearchParams,
        stop_token_ids: Iterable[int],
        max_model_len: int,
    ) -> None:
        """Raises RequestRejected, as the engine would, when the prompt and max_tokens do not
        fit `max_model_len`: the last steps' prompts would not."""
        check_fits(len(prompt_ids), params.max_tokens, max_model_len)
        self.params = params
        self.stop_ids = frozenset(stop_token_ids)
        self.num_prompt_tokens = len(prompt_ids)
        self.live = [Beam(list(prompt_ids))]
        self.complete: list[Beam] = []
        self.num_steps = 0
        self.failure: FinishReason | None = None  # a step the engine did not finish
        # Each beam's step: one token, with the candidates' log-probabilities.
        self.step_params = SamplingParams(
            temperature=params.temperature, max_tokens=1, logprobs=2 * params.beam_width
        )

    @property
    def done(self) -> bool:
        return not self.live or self.num_steps >= self.params.max_tokens or bool(self.failure)

    def score(self, beam: Beam) -> float:
        return self._score(beam.cum_logprob, len(beam.tokens), beam.tokens[-1])

    def _score(self, cum_logprob: float, length: int, last: int) -> float:
        """A beam's score from its log-probability, its token count and its last token."""
        length = max(1, length - (last in self.stop_ids))
        return cum_logprob / length**self.params.length_penalty

    def advance(self, steps: Sequence[CompletionOutput]) -> None:
        """Take each live beam's step (its one-token output, in `live`'s order); a step that
        ended without a token (abort, timeout, error) ends the search with that reason.

        Candidates are ranked before any is built, so only the kept ones copy their parent's
        tokens; the complete beams are kept to the best `beam_width`, all the result can use."""
        failed = [step for step in steps if not step.logprobs]
        if failed:
            self.failure = failed[0].finish_reason or FinishReason.ERROR
            return
        grown: list[tuple[Beam, int, dict[int, Logprob], float]] = []
        for beam, step in zip(self.live, steps, strict=True):
            candidates = step.logprobs[0]
            for token, logprob in candidates.items():
                grown.append((beam, token, candidates, beam.cum_logprob + logprob.logprob))
        ends = [] if self.params.ignore_eos else [c for c in grown if c[1] in self.stop_ids]
        if ends:
            grown = [c for c in grown if c[1] not in self.stop_ids]
        grown.sort(key=lambda c: self._score(c[3], len(c[0].tokens) + 1, c[1]), reverse=True)
        width = self.params.beam_width
        self.live = [_child(*candidate) for candidate in grown[:width]]
        if ends:
            self.complete += [_child(*candidate) for candidate in ends]
            self.complete = sorted(self.complete, key=self.score, reverse=True)[:width]
        self.num_steps += 1

    def best(self, decode: Callable[..., str]) -> list[Beam]:
        """The result, best first, each with its text (`decode`, a tokenizer's, of its own
        tokens) and why it ended: a stop token (stop), max_tokens (length), or the failure of
        a step."""
        ranked = sorted([*self.complete, *self.live], key=self.score, reverse=True)
        beams = ranked[: self.params.beam_width]
        for beam in beams:
            own = beam.tokens[self.num_prompt_tokens :]
            stopped = bool(own) and own[-1] in self.stop_ids and not self.params.ignore_eos
            beam.text = decode(own[:-1] if stopped else own)
            if stopped and self.params.include_stop_str_in_output:
                beam.text += decode(own[-1:], skip_special_tokens=False)
            beam.finish_reason = (
                FinishReason.STOP if stopped else self.failure or FinishReason.LENGTH
            )
        return beams

    def output(
        self, request_id: str, prompt: str | None, decode: Callable[..., str]
    ) -> RequestOutput:
        """The result as one finished RequestOutput with a CompletionOutput per beam."""
        beams = self.best(decode)
        prompt_ids = beams[0].tokens[: self.num_prompt_tokens]
        outputs = [
            CompletionOutput(
                index=i,
                text=beam.text or "",
                token_ids=beam.tokens[self.num_prompt_tokens :],
                finish_reason=beam.finish_reason,
                stop_reason=beam.tokens[-1] if beam.finish_reason is FinishReason.STOP else None,
            )
            for i, beam in enumerate(beams)
        ]
        return RequestOutput(request_id, prompt, prompt_ids, outputs, finished=True)


class _Generates(Protocol):
    tokenizer: Any
    max_model_len: int

    def generate(
        self, prompt: Any, params: SamplingParams, request_id: str, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]: ...


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    final = None
    async for final in outputs:  # noqa: B007 (the last one is the answer)
        pass
    assert final is not None
    return final


async def beam_search(
    engine: _Generates,
    prompt_ids: list[int],
    params: BeamSearchParams,
    request_id: str,
    *,
    prompt: str | None = None,
    cache_salt: str | None = None,
    timeout: float | None = None,
    **generate_kwargs: Any,
) -> AsyncIterator[RequestOutput]:
    """Run a beam search through `engine.generate` (an async engine, or the server's engine
    client); yields one finished RequestOutput, its outputs the best beams. Each step's
    requests are `request_id` plus the step and the beam; `timeout` bounds the whole search
    (a step cut short ends it, finish_reason "timeout"); `generate_kwargs` (lane, tenant)
    pass to every step. Closing the iterator early aborts the steps in flight."""
    search = BeamSearch(prompt_ids, params, engine.tokenizer.stop_token_ids, engine.max_model_len)
    deadline = None if timeout is None else time.monotonic() + timeout
    while not search.done:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        steps = [
            asyncio.ensure_future(
                _last(engine.generate(
                    beam.tokens if cache_salt is None
                    else {"prompt_token_ids": beam.tokens, "cache_salt": cache_salt},
                    search.step_params, f"{request_id}-{search.num_steps}-{i}",
                    timeout=left, **generate_kwargs,
                ))
            )
            for i, beam in enumerate(search.live)
        ]  # fmt: skip
        try:
            finals = await asyncio.gather(*steps)
        finally:  # one step refused or failed, or the caller left: abort the others
            for step in steps:
                step.cancel()
        search.advance([final.outputs[0] for final in finals])
    yield search.output(request_id, prompt, engine.tokenizer.decode)


_offline_ids = itertools.count()


def beam_search_offline(
    engine: LLMEngine,
    prompts: Prompt | Sequence[Prompt],
    params: BeamSearchParams,
    run: Callable[[list[str]], list[RequestOutput]],
) -> list[BeamSearchOutput]:
    """Each prompt's best beams through the offline engine: every step adds one request per
    live beam of every prompt, then `run(request ids)` steps the engine until they finish
    (returning their final outputs in that order). A prompt is one `add_request` takes."""
    if isinstance(prompts, str | dict):
        prompts = [prompts]
    searches: list[tuple[BeamSearch, str | None]] = []
    for prompt in prompts:
        _, ids, salt = engine.prompt_ids(prompt)
        search = BeamSearch(ids, params, engine.tokenizer.stop_token_ids, engine.max_model_len)
        searches.append((search, salt))
    while running := [(search, salt) for search, salt in searches if not search.done]:
        request_ids = []
        for search, salt in running:
            for beam in search.live:
                request_ids.append(f"beam-{next(_offline_ids)}")
                prompt = {"prompt_token_ids": beam.tokens, "cache_salt": salt}
                engine.add_request(request_ids[-1], prompt, search.step_params)
        steps = iter(run(request_ids))
        for search, _ in running:
            search.advance([next(steps).outputs[0] for _ in search.live])
    return [BeamSearchOutput(search.best(engine.tokenizer.decode)) for search, _ in searches]
