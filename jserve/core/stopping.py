"""When a sequence finishes and why: the one module that decides (pure Python, no jax).

A sequence finishes, checked after each generated token, by these rules:
1. a stop token: the token is in `stop_token_ids` (EOS unless `ignore_eos`, plus the user's
   `stop_token_ids`) and the sequence has at least `min_tokens` tokens -> STOP, `stop_reason`
   is None for one of the model's own stop tokens (EOS, and the end-of-turn tokens the
   tokenizer adds to it) and the token id for one of the user's `stop_token_ids` only. This
   is vLLM's rule (its EOS check comes first and leaves stop_reason None), held to every model
   stop token: which of them a GGUF or an HF checkpoint declares as *the* EOS differs, and the
   answer must not. The stop token's text is left out of the output, as vLLM leaves it out,
   unless the request sets `include_stop_str_in_output`;
2. `max_tokens` tokens -> LENGTH (an unset max_tokens was resolved to what max_model_len
   leaves, so this also covers the context limit);
3. a stop string: one of `stop` ends in the text of a token after the first `min_tokens`
   (vLLM's rule; it may begin earlier) -> STOP, `stop_reason` is the string and the text ends
   right before it (right after it with `include_stop_str_in_output`);
4. a complete grammar: the request's output constraint admits no further token (only EOS)
   -> STOP, `stop_reason` is None.
Below `min_tokens` the sampler also bans EOS and the stop ids (`min_tokens_banned_ids`), as
vLLM does, so a sequence cannot even sample them.

Rules 1-2 need only token counts: the scheduler applies them in `update_from_output`. Rule 3
needs detokenized text: the output processor applies it, feeding each sample's new text to its
`StopStringSearch`. Rule 4 needs the grammar's state, which the engine's matcher holds.
`StopConditions.decide` joins the four answers and the engine applies what it returns: rule 1
first, then 3, 2 and 4. So a stop string completed by the last token max_tokens allows still
cuts the text before it and ends the sequence with STOP, as vLLM's output processor does. The
server's mock engine calls this module too, so every test runs against the same semantics.
`check_stop_strings` states rule 3 on a whole text at once (the one-shot form, for a few
strings over a given text); `StopStringSearch` gives the same answers fed piece by piece, at a
cost per piece that grows neither with the text so far nor with the number of stop strings
(jserve.core.stop_automaton), which SamplingParams caps.

Other finish reasons come from outside a sequence: ABORT (the caller or client gave up) and
TIMEOUT (its deadline passed: jserve.core.deadlines). `FinishReason`'s values are the strings
that outputs and HTTP bodies carry.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from jserve.core.stop_automaton import ROOT, StopStringAutomaton
from jserve.outputs import FinishReason
from jserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class StopConditions:
    """One request's stop rules (shared by its `n` samples)."""

    max_tokens: int = 16
    min_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()  # EOS (unless ignore_eos) and the user's ids
    # The model's stop tokens among stop_token_ids (none with ignore_eos): stop_reason None.
    eos_token_ids: frozenset[int] = frozenset()
    stop_strings: tuple[str, ...] = ()
    min_tokens_banned_ids: tuple[int, ...] = ()  # sorted; EOS and stop ids, even with ignore_eos
    # Built once per request from stop_strings, shared by its samples' searches.
    _automaton: StopStringAutomaton | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        automaton = StopStringAutomaton(self.stop_strings) if self.stop_strings else None
        object.__setattr__(self, "_automaton", automaton)

    @classmethod
    def from_params(
        cls, params: SamplingParams, eos_token_ids: Iterable[int], max_tokens: int
    ) -> StopConditions:
        """`max_tokens` is params.max_tokens resolved against the prompt (never None)."""
        eos = frozenset(eos_token_ids)
        user_ids = frozenset(params.stop_token_ids)
        return cls(
            max_tokens=max_tokens,
            min_tokens=params.min_tokens,
            stop_token_ids=user_ids if params.ignore_eos else user_ids | eos,
            eos_token_ids=frozenset() if params.ignore_eos else eos,
            stop_strings=tuple(params.stop),
            min_tokens_banned_ids=tuple(sorted(user_ids | eos)),
        )

    def after_token(self, token_id: int, num_output_tokens: int) -> FinishReason | None:
        """Rules 1-2 once `token_id` made the output `num_output_tokens` long."""
        if token_id in self.stop_token_ids and num_output_tokens >= self.min_tokens:
            return FinishReason.STOP
        if num_output_tokens >= self.max_tokens:
            return FinishReason.LENGTH
        return None

    def token_stop_reason(self, token_id: int) -> int | None:
        """The `stop_reason` of a stop on `token_id` (rule 1): None for the model's own stop
        tokens, the id for the user's."""
        return None if token_id in self.eos_token_ids else token_id

    def stop_string_search(self) -> StopStringSearch:
        """Rule 3 for one sample: a search to feed its text as it grows."""
        return StopStringSearch(self._automaton, self.min_tokens)

    def banned_ids(self, num_output_tokens: int) -> tuple[int, ...]:
        """Ids the sampler must ban for the next token (none from min_tokens on)."""
        return self.min_tokens_banned_ids if num_output_tokens < self.min_tokens else ()

    def decide(
        self,
        token_id: int,
        by_token: FinishReason | None,
        stop_string: str | None,
        grammar_complete: bool,
    ) -> StopDecision | None:
        """Whether the sequence finishes with `token_id`, and how: rules 1, 3, 2, 4 in that
        order, from `after_token`'s answer (`by_token`), the stop string `StopStringSearch`
        found, and whether the request's grammar is complete (False for an unconstrained
        request)."""
        if by_token is FinishReason.STOP:
            return StopDecision(by_token, self.token_stop_reason(token_id))
        if stop_string is not None:
            return StopDecision(FinishReason.STOP, stop_string)
        if by_token is not None:
            return StopDecision(by_token, None)
        if grammar_complete:
            return StopDecision(FinishReason.STOP, None)
        return None


@dataclass(frozen=True, slots=True)
class StopDecision:
    """How a sequence finishes: its finish reason and `stop_reason` (the stop token id, the
    stop string, or None)."""

    reason: FinishReason
    stop_reason: int | str | None


@dataclass(frozen=True, slots=True)
class StopStringCheck:
    """Result of `check_stop_strings` and `StopStringSearch.add_text`.

    Attributes:
        stop: the stop string that occurs first in the text, or None.
        end: with a stop string, `text[:end]` is the final output (cut right before it);
            without, `text[:end]` is safe to emit now: the rest might be the start of a stop
            string that the next tokens complete.
    """

    stop: str | None
    end: int


def check_stop_strings(
    text: str, stop_strings: Sequence[str], search_from: int = 0
) -> StopStringCheck:
    """Find the stop string that starts first in `text`, and how much of `text` can be streamed.

    Streaming use, per step: `text` is all the text so far, `search_from` its length before this
    step's delta (earlier text was already searched); emit `text[emitted:check.end]`; stop the
    sequence if `check.stop` is set. A sequence that ends for another reason (EOS, length) emits
    all of `text`. Each call costs O(stop strings x their length) and needs the whole text: the
    engine streams through `StopStringSearch` instead, which answers the same per piece.

    Raises:
        ValueError: a stop string is empty (it would match everywhere).
    """
    best_index, best_stop = len(text) + 1, None
    for stop in stop_strings:
        if not stop:
            raise ValueError(f"stop strings must be non-empty, got {list(stop_strings)!r}")
        # A match found now must end in the new text, so it starts at most len(stop)-1 earlier.
        index = text.find(stop, max(0, search_from - len(stop) + 1))
        if index != -1 and index < best_index:
            best_index, best_stop = index, stop
    if best_stop is not None:
        return StopStringCheck(stop=best_stop, end=best_index)
    held_back = max((_partial_suffix_length(text, stop) for stop in stop_strings), default=0)
    return StopStringCheck(stop=None, end=len(text) - held_back)


def _partial_suffix_length(text: str, stop: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `stop`."""
    for length in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:length]):
            return length
    return 0


class StopStringSearch:
    """Rule 3 for one sample, fed its text piece by piece: `add_text(new_text, n)` answers as
    `check_stop_strings(text, stop_strings, search_from=len(text) - len(new_text))` would
    (`text` being all the pieces so far), or, up to `min_tokens` (n output tokens), with no
    stop and all of `text`. A piece costs O(its length) amortized: the sample keeps only its
    place in the request's automaton and the length of its text.
    """

    __slots__ = ("_automaton", "_length", "_min_tokens", "_state")

    def __init__(self, automaton: StopStringAutomaton | None, min_tokens: int) -> None:
        self._automaton = automaton
        self._min_tokens = min_tokens
        self._state = ROOT
        self._length = 0  # characters fed so far

    def add_text(self, new_text: str, num_output_tokens: int) -> StopStringCheck:
        """Feed the sample's new text, once it has `num_output_tokens` tokens; `end` counts
        from the start of all the text fed."""
        start = self._length
        self._length += len(new_text)
        if self._automaton is None:
            return StopStringCheck(stop=None, end=self._length)
        searching = num_output_tokens > self._min_tokens
        self._state, found = self._automaton.advance(self._state, new_text, report=searching)
        if found is not None:
            offset, index = found
            return StopStringCheck(self._automaton.stop_strings[index], start + offset)
        held_back = self._automaton.held_back(self._state) if searching else 0
        return StopStringCheck(stop=None, end=self._length - held_back)
