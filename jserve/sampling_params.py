"""Sampling parameters with vLLM's field names and defaults, validated on construction.

Normalisation (so the engine sees one spelling of each choice): `stop` becomes a list of
strings, `stop_token_ids` a list of ints, and `top_k=-1` (vLLM's older "off") becomes 0.

`structured_outputs` (vLLM's StructuredOutputsParams) constrains the output to a JSON schema,
any JSON object, a regex, a choice of strings or a grammar; jserve.structured compiles it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from jserve.config.grammar_size import check_grammar
from jserve.config.regex_size import check_json_schema, check_regex
from jserve.config.validation import (
    FLOAT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_float,
    check_int,
    is_int,
    show,
)

MAX_LOGPROBS = 20
# Entries of one request's logit_bias: the sampler holds this many (id, bias) pairs a row
# (OpenAI documents no cap; vLLM has none). Biases lie in OpenAI's [-100, 100].
MAX_LOGIT_BIAS = 300
MAX_BIAS = 100.0

# Caps on `stop` (vLLM has none; OpenAI allows 4 strings). They bound what one request can cost
# everyone else: its stop strings' automaton is built on the engine's step thread, in time
# proportional to their total length (jserve.core.stop_automaton), and each one's length bounds
# the text held back from a stream. No real stop list comes near them.
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_LENGTH = 512  # characters
MAX_STOP_TOTAL_LENGTH = 2048  # characters, all the strings together


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_truncate_prompt_tokens(value: object) -> None:
    _check(
        value is None or (is_int(value) and (value == -1 or value >= 1)),  # type: ignore[operator]
        f"truncate_prompt_tokens must be -1 (the model's max_model_len) or an integer >= 1, "
        f"got {show(value)}",
    )


def truncate_prompt(ids: list[int], keep: int | None, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the last `keep` ids of a prompt (left truncation, so
    the text nearest the answer stays), all of them if it is shorter or `keep` is None; -1 keeps
    up to max_model_len. More than max_model_len is a ValueError: no request could use them."""
    _check_truncate_prompt_tokens(keep)
    if keep is None:
        return ids
    keep = max_model_len if keep == -1 else keep
    _check(
        keep <= max_model_len,
        f"truncate_prompt_tokens ({keep}) must be at most max_model_len ({max_model_len}); "
        f"send a smaller truncation size, or -1 for max_model_len",
    )
    return ids[-keep:]


class StructuredKind(StrEnum):
    """The kinds of output constraint, each named as its StructuredOutputsParams field."""

    JSON = "json"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutputsParams:
    """Exactly one output constraint, vLLM's field names: `json` a JSON schema (a dict or its
    JSON text), `json_object` any JSON object, `regex`, `choice` one of these strings, `grammar`
    a Lark or GBNF grammar. Whether the constraint compiles is the engine's check (it needs
    the grammar engine and the tokenizer); here its shape is checked, and that unrolling the
    counted repetitions of its regexes (and Lark definitions) adds at most
    jserve.config.regex_size.MAX_REGEX_SIZE nodes (more would cost the grammar engine seconds
    before it refused)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [str(k) for k in StructuredKind if getattr(self, k) not in (None, False)]
        _check(
            len(given) == 1,
            f"structured outputs need exactly one of {[str(k) for k in StructuredKind]}, got "
            f"{given or 'none'}",
        )
        _check(
            self.json is None or isinstance(self.json, str | dict),
            "structured outputs 'json' must be a JSON schema (an object or its JSON text)",
        )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            _check(
                value is None or (isinstance(value, str) and value != ""),
                f"structured outputs '{name}' must be a non-empty string",
            )
        _check(
            self.choice is None
            or (bool(self.choice) and all(isinstance(c, str) and c for c in self.choice)),
            "structured outputs 'choice' must be a non-empty list of non-empty strings",
        )
        if self.json is not None:
            check_json_schema(self.json)
        elif self.regex is not None:
            check_regex(self.regex)
        elif self.grammar is not None:
            check_grammar(self.grammar)

    @property
    def kind(self) -> StructuredKind:
        """Which kind of constraint is set."""
        return next(k for k in StructuredKind if getattr(self, k) not in (None, False))


@dataclass
class SamplingParams:
    """How to sample one request; `temperature == 0` means greedy.

    `max_tokens=None` means "up to max_model_len" (the engine resolves it per prompt).
    `top_k` 0 (or -1) and `top_p` 1 and `min_p` 0 switch those filters off.
    `stop` holds at most MAX_STOP_STRINGS (128) non-empty strings, each at most
    MAX_STOP_STRING_LENGTH (512) characters and MAX_STOP_TOTAL_LENGTH (2048) in all.
    `include_stop_str_in_output` (vLLM's) keeps the matched stop string, or the text of the
    stop token that ended a sample, at the end of its text; by default both are left out.
    `truncate_prompt_tokens` (vLLM's) serves only the prompt's last tokens (`truncate_prompt`).
    `allowed_token_ids` (vLLM's) restricts every sampled token to those ids (logprobs stay the
    model's own, as vLLM's raw logprobs); `bad_words` (vLLM's) are never generated
    (jserve.core.bad_words). `logit_bias` (OpenAI's) adds its bias to each listed token id's
    logit before the penalties, as vLLM does; logprobs stay raw.
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
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # vLLM's: False writes an added token right after another without the space the decoder
    # puts between them (only with skip_special_tokens False; jserve.loaders.detokenizer)
    spaces_between_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    include_stop_str_in_output: bool = False
    truncate_prompt_tokens: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    logit_bias: dict[int, float] | None = None

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = list(self.allowed_token_ids)
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        if self.logit_bias is not None:
            self.logit_bias = dict(self.logit_bias)
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
        self._validate_stop()
        for i, token in enumerate(self.stop_token_ids):
            check_int(f"stop_token_ids[{i}]", token, 0)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            check_int("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        check_float("repetition_penalty", self.repetition_penalty, 0.0, 2.0, lo_open=True)
        _check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        self._validate_allowed_token_ids()
        self._validate_logit_bias()
        _check(
            self.bad_words is None or all(isinstance(w, str) and w.strip() for w in self.bad_words),
            f"bad_words must be a list of words (non-blank strings), got {show(self.bad_words)}",
        )

    def _validate_allowed_token_ids(self) -> None:
        if self.allowed_token_ids is None:
            return
        _check(
            len(self.allowed_token_ids) > 0,
            "allowed_token_ids must hold at least one token id (leave it out to allow all)",
        )
        for i, token in enumerate(self.allowed_token_ids):
            check_int(f"allowed_token_ids[{i}]", token, 0)
        _check(
            self.structured_outputs is None,
            "allowed_token_ids cannot be combined with structured outputs: the constraint "
            "decides which tokens may come next",
        )

    def _validate_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        _check(
            len(self.logit_bias) <= MAX_LOGIT_BIAS,
            f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} are served",
        )
        for token, bias in self.logit_bias.items():
            check_int("logit_bias token id", token, 0)
            check_float(f"logit_bias[{show(token)}]", bias, -MAX_BIAS, MAX_BIAS)

    def _validate_stop(self) -> None:
        _check(
            all(isinstance(s, str) and s for s in self.stop),
            f"stop must be a non-empty string or a list of non-empty strings, got "
            f"{show(self.stop)}",
        )
        _check(
            len(self.stop) <= MAX_STOP_STRINGS,
            f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed",
        )
        longest = max(self.stop, key=len, default="")
        _check(
            len(longest) <= MAX_STOP_STRING_LENGTH,
            f"stop strings must be at most {MAX_STOP_STRING_LENGTH} characters long, got one "
            f"of {len(longest)}: {show(longest)}",
        )
        total = sum(map(len, self.stop))
        _check(
            total <= MAX_STOP_TOTAL_LENGTH,
            f"stop strings must be at most {MAX_STOP_TOTAL_LENGTH} characters long in all, got "
            f"{total}",
        )


class PoolingType(StrEnum):
    """How an embedding request pools its prompt's final hidden states (vLLM's pooler
    `pooling_type`, lower case): the last token's, or the mean over every prompt token."""

    LAST = "last"
    MEAN = "mean"


@dataclass(frozen=True)
class PoolingParams:
    """An embedding request (vLLM's PoolingParams, embed task): its prompt is prefilled, its
    final hidden states (after the final norm) pooled by `pooling_type` and L2-normalized,
    and nothing is generated. `truncate_prompt_tokens` as SamplingParams'."""

    pooling_type: PoolingType = PoolingType.LAST
    truncate_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_truncate_prompt_tokens(self.truncate_prompt_tokens)
        try:
            object.__setattr__(self, "pooling_type", PoolingType(self.pooling_type))
        except ValueError:
            names = [str(t) for t in PoolingType]
            raise ValueError(
                f"pooling_type must be one of {names}, got {show(self.pooling_type)}"
            ) from None


MAX_BEAM_WIDTH = MAX_LOGPROBS // 2  # a step asks for 2 * beam_width candidates per beam


@dataclass(frozen=True)
class BeamSearchParams:
    """A beam search (vLLM's BeamSearchParams; jserve.engine.beam_search runs it): the best
    `beam_width` continuations of at most `max_tokens` tokens by cumulative log-probability,
    ranked by `cumulative logprob / length ** length_penalty` (length counting the prompt, not
    a final stop token, as vLLM does). `temperature` samples each step's own token, which
    joins that step's candidates (vLLM's rule); 0 adds none beyond the top ones. A beam ends
    at a stop token unless `ignore_eos`; `include_stop_str_in_output` keeps that token's text."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        check_int("beam_width", self.beam_width, 1, MAX_BEAM_WIDTH)
        check_int("max_tokens", self.max_tokens, 1)
        check_float("temperature", self.temperature, 0.0)
        check_float("length_penalty", self.length_penalty, -FLOAT32_MAX)
        for name in ("ignore_eos", "include_stop_str_in_output"):
            _check(isinstance(getattr(self, name), bool), f"{name} must be a bool")
