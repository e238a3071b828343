"""Sampling parameters with vLLM's field names and defaults, validated on construction.

Normalisation (so the engine sees one spelling of each choice): `stop` becomes a list of
strings, `stop_token_ids` a list of ints, and `top_k=-1` (vLLM's older "off") becomes 0.
"""

from __future__ import annotations

from dataclasses import dataclass

from jserve.validation import INT64_MAX, INT64_MIN, check_float, check_int, show

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
        """Model-independent checks (token ids against the vocabulary are the engine's)."""
        check_int("n", self.n, 1)
        check_float("temperature", self.temperature, 0.0)
        check_float("top_p", self.top_p, 0.0, 1.0, lo_open=True)
        check_int("top_k", self.top_k, 0)  # -1 (off) was normalised to 0
        check_float("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            check_int("seed", self.seed, INT64_MIN, INT64_MAX)
        if self.max_tokens is not None:
            check_int("max_tokens", self.max_tokens, 1)
        check_int("min_tokens", self.min_tokens, 0)
        _check(
            self.max_tokens is None or self.min_tokens <= self.max_tokens,
            f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
        )
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of non-empty strings, got "
            f"{show(self.stop)}",
        )
        for i, token in enumerate(self.stop_token_ids):
            check_int(f"stop_token_ids[{i}]", token, 0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
