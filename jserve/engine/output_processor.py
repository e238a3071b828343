"""Per-request output state: detokenization, stop strings, logprobs and RequestOutput building.

The engine feeds each sampled token here; this module knows nothing of scheduling or devices.
A request with `n > 1` has one `SampleState` per sample, all reported in one RequestOutput.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from jserve.core.stopping import StopConditions, StopStringSearch
from jserve.engine.pooling import Pooler
from jserve.loaders.detokenizer import IncrementalDetokenizer
from jserve.loaders.tokenizer import Tokenizer
from jserve.outputs import (
    CompletionOutput,
    FinishReason,
    GrowingText,
    Logprob,
    RequestMetrics,
    RequestOutput,
    SequencePrefix,
    TextPrefix,
)
from jserve.sampling_params import PoolingParams, PoolingType, SamplingParams


@dataclass
class SampleState:
    """One of a request's `n` samples. What it generated only grows (text, ids, logprobs), so a
    snapshot of it costs O(1): see jserve.outputs. Each new token costs O(its text)."""

    index: int
    detokenizer: IncrementalDetokenizer
    stop_search: StopStringSearch
    logprobs: list[dict[int, Logprob]] | None
    token_ids: list[int] = field(default_factory=list)
    text: GrowingText = field(default_factory=GrowingText)
    text_end: int = 0  # text[:text_end] is the output; the rest may begin a stop string
    final: CompletionOutput | None = None  # once finished, what every snapshot returns

    def snapshot(self) -> CompletionOutput:
        if self.final is not None:
            return self.final
        logprobs = self.logprobs
        return CompletionOutput(
            self.index,
            TextPrefix(self.text, self.text_end),  # type: ignore[arg-type]  # read as a str
            SequencePrefix(self.token_ids, len(self.token_ids)),
            None if logprobs is None else SequencePrefix(logprobs, len(logprobs)),
        )

    def finish(self, reason: FinishReason, stop_reason: int | str | None) -> None:
        """Hand out plain values from now on: nothing will append to them any more."""
        self.final = CompletionOutput(
            self.index, self.text.prefix(self.text_end), self.token_ids, self.logprobs,
            reason, stop_reason,
        )  # fmt: skip


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
    # params.prompt_logprobs: an entry per prompt token scored so far, None for the first
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_row_params: SamplingParams | None = None  # the sampler's params of a prompt row
    pooler: Pooler | None = None  # an embedding request's (no sampled token is kept)
    embedding: list[float] | None = None

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
        pooling: PoolingParams | None = None,
    ) -> RequestState:
        state = cls(
            request_id, prompt, prompt_token_ids, params, stop, tokenizer,
            RequestMetrics(arrival_time),
        )  # fmt: skip
        if params.prompt_logprobs is not None:
            state.prompt_logprobs = [None]
            state.prompt_row_params = SamplingParams(
                temperature=0.0, logprobs=params.prompt_logprobs
            )
        if pooling is not None:
            state.pooler = Pooler(pooling.pooling_type, len(prompt_token_ids))
        for i in range(params.n):
            detok = IncrementalDetokenizer(
                tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            logprobs = [] if params.logprobs is not None else None
            state.samples.append(SampleState(i, detok, stop.stop_string_search(), logprobs))
        return state

    @property
    def finished(self) -> bool:
        return all(s.final is not None for s in self.samples)

    def add_token(
        self,
        index: int,
        token_id: int,
        top_logprobs: list[tuple[int, float]] | None = None,
        stop_token: bool = False,
    ) -> str | None:
        """Record sample `index`'s new token; returns the stop string it completed, if any
        (the rule: jserve.core.stopping).

        `top_logprobs` lists (token id, logprob) pairs, the sampled token first. A
        `stop_token` (one that ends the sample: EOS or one of the request's stop_token_ids)
        adds no text unless the request asked for include_stop_str_in_output, as in vLLM.
        """
        now = time.monotonic()
        m = self.metrics
        m.first_token_time = m.first_token_time or now
        m.last_token_time = now
        sample = self.samples[index]
        sample.token_ids.append(token_id)
        if sample.logprobs is not None and top_logprobs is not None:
            decode = self.tokenizer.decode
            sample.logprobs.append(
                {
                    tid: Logprob(lp, decode([tid], skip_special_tokens=False))
                    for tid, lp in top_logprobs
                }
            )
        include_stop = self.params.include_stop_str_in_output
        if stop_token and not include_stop:
            return None
        new_text = sample.detokenizer.add_token(token_id)
        sample.text.append(new_text)
        check = sample.stop_search.add_text(new_text, len(sample.token_ids))
        sample.text_end = check.end
        if check.stop is not None and include_stop:
            sample.text_end += len(check.stop)
        return check.stop

    @property
    def wants_prompt_rows(self) -> bool:
        """Whether its steps compute a row at every prompt position (prompt logprobs, mean
        pooling): jserve.core.request.Request.prompt_rows."""
        pooler = self.pooler
        mean = pooler is not None and pooler.pooling_type is PoolingType.MEAN
        return mean or (self.prompt_logprobs is not None and len(self.prompt_token_ids) > 1)

    def add_prompt_logprob(
        self, position: int, logprob: float, rank: int, top: list[tuple[int, float]]
    ) -> None:
        """Record the prompt token at `position`'s logprob and rank and the top n (id,
        logprob) pairs there, unless recorded already (a chunk recomputed after preemption,
        or another sample's rows)."""
        scored = self.prompt_logprobs
        if scored is None or position != len(scored):
            return
        decode = self.tokenizer.decode
        token = self.prompt_token_ids[position]
        entry = {token: Logprob(logprob, decode([token], skip_special_tokens=False), rank)}
        for i, (tid, lp) in enumerate(top):
            if tid not in entry:
                entry[tid] = Logprob(lp, decode([tid], skip_special_tokens=False), i + 1)
        scored.append(entry)

    def finish_pooled(self) -> None:
        """End an embedding request: its prompt is pooled (ValueError if a row is missing)."""
        assert self.pooler is not None
        self.embedding = self.pooler.embedding()
        self.finish_sample(0, FinishReason.STOP)

    def finish_sample(
        self, index: int, reason: FinishReason, stop_reason: int | str | None = None
    ) -> None:
        """End sample `index`: release held-back text (unless cut at a stop string)."""
        sample = self.samples[index]
        if sample.final is not None:
            return
        if not isinstance(stop_reason, str):  # a stop string already cut the text before it
            sample.text.append(sample.detokenizer.finish())
            sample.text_end = len(sample.text)
        sample.finish(reason, stop_reason)
        if self.finished:
            self.metrics.finished_time = time.monotonic()

    def to_output(self) -> RequestOutput:
        """A snapshot: later tokens do not change what was handed out."""
        scored = self.prompt_logprobs
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.snapshot() for s in self.samples],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            error=self.error,
            prompt_logprobs=None if scored is None else SequencePrefix(scored, len(scored)),
            embedding=self.embedding,
        )
