"""Result types shaped like vLLM's, because users and servers already know that shape."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a sequence ended (jserve.core.stopping decides STOP and LENGTH); the values are the
    strings outputs and HTTP bodies carry."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens (or the context limit) reached
    ABORT = "abort"  # the caller or the client ended it
    TIMEOUT = "timeout"  # unfinished at its deadline
    ERROR = "error"  # the engine failed it (its host-side step work raised, or a device step)


@dataclass
class Logprob:
    """Log-probability of one token, with its decoded text."""

    logprob: float
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    """One sampled continuation of a request (there are `n` of them).

    `text` and `token_ids` are cumulative; streaming consumers take deltas themselves.
    `logprobs[i]` maps token id -> Logprob for position i (sampled token plus the top-n), or is
    None when logprobs were not requested.
    """

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: FinishReason | None = None  # a str: stop, length, abort, timeout, error
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.monotonic()) of a request's milestones."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    error: str | None = None  # why the engine failed this request (finish_reason "error")


@dataclass
class EngineStats:
    """A snapshot of what operators watch; counters are cumulative since start."""

    num_requests_running: int = 0
    num_requests_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of allocatable blocks in use, 0..1
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0  # tokens found
    num_preemptions: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    compilations: int = 0
    serving_compilations: int = 0  # after warm-up: should stay 0
    num_restarts: int = 0  # in-process engine restarts after a failed device step
    # Scheduled tokens of each iteration since the previous snapshot (drained by the reader).
    iteration_tokens: list[int] = field(default_factory=list)
