"""Sampling parameters with vLLM's field names and defaults, validated on construction.

Normalisation (so the engine sees one spelling of each choice): `stop` becomes a list of
strings, `stop_token_ids` a list of ints, and `top_k=-1` (vLLM's older "off") becomes 0.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_LOGPROBS = 20


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass
class SamplingParams:
    """How to sample one request; `temperature == 0` means greedy.

    `max_tokens=None` means "up to max_model_len" (the engine resolves it per prompt).
    `top_k` 0 (or -1) and `top_p` 1 and `min_p` 0 switch those filters off.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(_is_int(self.n) and self.n >= 1, f"n must be an integer >= 1, got {self.n!r}")
        _check(self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}")
        _check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}")
        _check(
            _is_int(self.top_k) and self.top_k >= 0,
            f"top_k must be 0 or -1 (off) or an integer >= 1, got {self.top_k!r}",
        )
        _check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}")
        _check(
            self.seed is None or _is_int(self.seed),
            f"seed must be an integer or None, got {self.seed!r}",
        )
        _check(
            self.max_tokens is None or (_is_int(self.max_tokens) and self.max_tokens >= 1),
            f"max_tokens must be an integer >= 1 or None, got {self.max_tokens!r}",
        )
        _check(
            _is_int(self.min_tokens) and self.min_tokens >= 0,
            f"min_tokens must be an integer >= 0, got {self.min_tokens!r}",
        )
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}",
        )
        _check(
            all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be integers >= 0, got {self.stop_token_ids!r}",
        )
        _check(
            self.logprobs is None
            or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_LOGPROBS),
            f"logprobs must be None or an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}",
        )
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, f"{name} must be in [-2, 2], got {value}")
        _check(
            0.0 < self.repetition_penalty <= 2.0,
            f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}",
        )


def _is_int(value: object) -> bool:
    # bool is an int subclass; `n=True` is a caller's mistake, not 1.
    return isinstance(value, int) and not isinstance(value, bool)
