"""Per-request output state: detokenization, stop strings, logprobs and RequestOutput building.

The engine feeds each sampled token here; this module knows nothing of scheduling or devices.
A request with `n > 1` has one `SampleState` per sample, all reported in one RequestOutput.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field

from jserve.core.stopping import StopConditions, StopStringSearch
from jserve.loaders.detokenizer import IncrementalDetokenizer
from jserve.loaders.tokenizer import Tokenizer
from jserve.outputs import CompletionOutput, FinishReason, Logprob, RequestMetrics, RequestOutput
from jserve.sampling_params import SamplingParams


@dataclass
class SampleState:
    """One of a request's `n` samples."""

    completion: CompletionOutput
    detokenizer: IncrementalDetokenizer
    stop_search: StopStringSearch


@dataclass
class RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    stop: StopConditions
    tokenizer: Tokenizer
    metrics: RequestMetrics
    samples: list[SampleState] = field(default_factory=list)
    num_cached_tokens: int = 0
    error: str | None = None  # set when the engine fails the request (finish_reason "error")

    @classmethod
    def create(
        cls,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        stop: StopConditions,
        tokenizer: Tokenizer,
        arrival_time: float,
    ) -> RequestState:
        state = cls(
            request_id, prompt, prompt_token_ids, params, stop, tokenizer,
            RequestMetrics(arrival_time),
        )  # fmt: skip
        for i in range(params.n):
            detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens)
            logprobs = [] if params.logprobs is not None else None
            completion = CompletionOutput(i, logprobs=logprobs)
            state.samples.append(SampleState(completion, detok, stop.stop_string_search()))
        return state

    @property
    def finished(self) -> bool:
        return all(s.completion.finished for s in self.samples)

    def add_token(
        self,
        index: int,
        token_id: int,
        top_logprobs: list[tuple[int, float]] | None = None,
    ) -> str | None:
        """Record sample `index`'s new token; returns the stop string it completed, if any
        (the rule: jserve.core.stopping).

        `top_logprobs` lists (token id, logprob) pairs, the sampled token first.
        """
        now = time.monotonic()
        m = self.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        sample = self.samples[index]
        out = sample.completion
        out.token_ids.append(token_id)
        if out.logprobs is not None and top_logprobs is not None:
            decode = self.tokenizer.decode
            out.logprobs.append(
                {
                    tid: Logprob(lp, decode([tid], skip_special_tokens=False))
                    for tid, lp in top_logprobs
                }
            )
        detok = sample.detokenizer
        searched = len(detok.text)
        detok.add_tokens([token_id])
        check = sample.stop_search.add_text(detok.text[searched:], len(out.token_ids))
        out.text = detok.text[: check.end]
        return check.stop

    def finish_sample(
        self, index: int, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End sample `index`: release held-back text (unless cut at a stop string)."""
        sample = self.samples[index]
        out = sample.completion
        if out.finished:
            return
        if not isinstance(stop_reason, str):  # a stop string already cut the text before it
            sample.detokenizer.finish()
            out.text = sample.detokenizer.text
        out.finish_reason = reason
        out.stop_reason = stop_reason
        if self.finished:
            self.metrics.finished_time = time.monotonic()

    def to_output(self) -> RequestOutput:
        """A snapshot: later tokens do not change what was handed out."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[_snapshot(s.completion) for s in self.samples],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
        )


def _snapshot(out: CompletionOutput) -> CompletionOutput:
    return dataclasses.replace(
        out,
        token_ids=out.token_ids[:],
        logprobs=None if out.logprobs is None else out.logprobs[:],
    )
