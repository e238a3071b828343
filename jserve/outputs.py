"""Result types shaped like vLLM's, because users and servers already know that shape.

A running request's outputs are snapshots taken every step, and each holds everything generated
so far; copying that into each one would cost O(text) a step. So an unfinished snapshot shares
what the engine appends to: `token_ids` and `logprobs` are `SequencePrefix` views of lists that
only grow, and `text` is a `TextPrefix` of a `GrowingText`, turned into a str when first read.
A finished output holds a plain str and plain lists.
"""

from __future__ import annotations

import enum
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

T = TypeVar("T")


class FinishReason(enum.StrEnum):
    """Why a sequence ended (jserve.core.stopping decides STOP and LENGTH); the values are the
    strings outputs and HTTP bodies carry."""

    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens (or the context limit) reached
    ABORT = "abort"  # the caller or the client ended it
    TIMEOUT = "timeout"  # unfinished at its deadline
    ERROR = "error"  # the engine failed it (its host-side step work raised, or a device step)


class EngineState(enum.StrEnum):
    """Whether an engine takes work: READY; STOPPING (shutting down, it admits nothing new);
    DEAD (its step loop failed for good: its `dead_reason` says why)."""

    READY = "ready"
    STOPPING = "stopping"
    DEAD = "dead"


class SequencePrefix(Sequence[T]):
    """The first `length` items of a list that only ever grows (nothing replaces or removes its
    items): a read-only snapshot that costs O(1). Slices are lists; it equals a list or another
    prefix with the same items."""

    __slots__ = ("_items", "_length")

    def __init__(self, items: list[T], length: int) -> None:
        self._items = items
        self._length = length

    def __len__(self) -> int:
        return self._length

    @overload
    def __getitem__(self, index: int) -> T: ...
    @overload
    def __getitem__(self, index: slice) -> list[T]: ...
    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            return self._items[slice(*index.indices(self._length))]
        position = index + self._length if index < 0 else index
        if not 0 <= position < self._length:
            raise IndexError(f"index {index} is out of range for {self._length} items")
        return self._items[position]

    def __iter__(self) -> Iterator[T]:
        return itertools.islice(self._items, self._length)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, list | SequencePrefix):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(self[:])


class GrowingText:
    """Text that only grows, piece by piece: appending costs O(piece), and handing out a prefix
    of it (a `TextPrefix`) O(1). Reading a prefix as a str joins the pieces not joined yet onto
    the last join: one copy of the text per read, on the reader's thread, not the step's."""

    __slots__ = ("_joined", "_length", "_pieces")

    def __init__(self) -> None:
        self._pieces: list[str] = []
        self._length = 0
        self._joined: tuple[str, int] = ("", 0)  # the first k pieces joined, and k

    def __len__(self) -> int:
        return self._length

    def append(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._length += len(piece)

    def prefix(self, length: int) -> str:
        """The first `length` (at most len(self)) characters, as a str."""
        joined, count = self._joined  # one tuple: safe to read while another thread appends
        if len(joined) < length:
            pieces = self._pieces[count:]
            joined = joined + "".join(pieces)
            self._joined = (joined, count + len(pieces))
        return joined[:length]


@dataclass(frozen=True, slots=True)
class TextPrefix:
    """The first `length` characters of `text`, read as a str by `CompletionOutput.text`."""

    text: GrowingText
    length: int

    def __str__(self) -> str:
        return self.text.prefix(self.length)


class _TextField:
    """`CompletionOutput.text`: a str whenever read. It may be set to a `TextPrefix`, which the
    first read turns into the str, once (a dataclass field whose default is a descriptor)."""

    def __get__(self, obj: Any, owner: type | None = None) -> str:
        if obj is None:
            return ""  # the field's default
        value = obj.__dict__["_text"]
        if isinstance(value, TextPrefix):
            value = obj.__dict__["_text"] = str(value)
        return value

    def __set__(self, obj: Any, value: str | TextPrefix) -> None:
        obj.__dict__["_text"] = value


@dataclass
class Logprob:
    """Log-probability of one token, with its decoded text and, for prompt logprobs, its
    rank (1 + the tokens more likely at that position; vLLM's Logprob)."""

    logprob: float
    decoded_token: str | None = None
    rank: int | None = None


@dataclass
class CompletionOutput:
    """One sampled continuation of a request (there are `n` of them).

    `text` and `token_ids` are cumulative; streaming consumers take deltas themselves.
    `logprobs[i]` maps token id -> Logprob for position i (sampled token plus the top-n), or is
    None when logprobs were not requested. While unfinished, `token_ids` and `logprobs` are
    read-only views and `text` may be set to a TextPrefix (see the module docstring).
    """

    index: int
    text: str = _TextField()  # type: ignore[assignment]
    token_ids: Sequence[int] = field(default_factory=list)
    logprobs: Sequence[dict[int, Logprob]] | None = None
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
    # SamplingParams.prompt_logprobs: one entry a prompt token, None for the first (vLLM's)
    prompt_logprobs: Sequence[dict[int, Logprob] | None] | None = None
    embedding: list[float] | None = None  # an embedding request's (PoolingParams) once finished


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
    # Speculative decoding (vLLM's spec_decode_* counters; jserve.engine.spec_decode).
    spec_decode_num_drafts: int = 0  # verify steps of one sequence
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # Scheduled tokens of each iteration since the previous snapshot (drained by the reader).
    iteration_tokens: list[int] = field(default_factory=list)

    @property
    def spec_decode_acceptance_rate(self) -> float:
        """Accepted draft tokens per draft token (0 before any)."""
        drafted = self.spec_decode_num_draft_tokens
        return self.spec_decode_num_accepted_tokens / drafted if drafted else 0.0

    @property
    def spec_decode_mean_acceptance_length(self) -> float:
        """Tokens a verify step produces on average: its accepted drafts plus the target's
        own token (vLLM's mean acceptance length; 0 before any)."""
        drafts = self.spec_decode_num_drafts
        return 1.0 + self.spec_decode_num_accepted_tokens / drafts if drafts else 0.0
