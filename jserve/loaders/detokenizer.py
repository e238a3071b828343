"""Streaming text from token ids: incremental detokenization and stop strings.

Why a window and two offsets (the scheme vLLM and TGI use): one token can carry part of a UTF-8
character (byte-level BPE splits "😀" into three tokens), and some decoders change the first token
of a sequence (SentencePiece drops its leading space). So each step decodes a short window,
`ids[prefix_offset:]`, and emits what it adds beyond `ids[prefix_offset:read_offset]`, whose text
was already emitted. While the window's text ends in U+FFFD, the last character may still be
incomplete: nothing is emitted and the offsets stay. Once it ends in a whole character, UTF-8 is
self-synchronising, so text decoded from there on appends exactly to what came before; that is why
the emitted pieces concatenate to `decode(all ids)`. Each step costs O(window), not O(sequence).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from jserve.loaders.tokenizer import Tokenizer

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text deltas, as they arrive.

    Call `add_tokens` with each new id (or a few), then `finish` once the sequence ends: it
    releases text held back because it ended in U+FFFD (e.g. a last token that stops mid-character
    for good). `text` is everything emitted so far. Several ids added at once are emitted
    together: if their text ends mid-character, all of it waits for the next step.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0  # start of the decode window
        self._read_offset = 0  # ids before this are emitted
        self._prefix_text: str | None = ""  # decode(ids[prefix:read]); None until needed

    def _decode(self, start: int, stop: int | None = None) -> str:
        return self._tokenizer.decode(
            self.token_ids[start:stop], skip_special_tokens=self._skip_special_tokens
        )

    def add_tokens(self, token_ids: Iterable[int]) -> str:
        """Append ids; return the new text that is certain (possibly "")."""
        self.token_ids.extend(token_ids)
        return self._advance(flush=False)

    def finish(self) -> str:
        """Return whatever text is still held back; call once when the sequence ends."""
        return self._advance(flush=True)

    def _advance(self, flush: bool) -> str:
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset)
        if len(window_text) <= len(self._prefix_text):
            return ""  # e.g. only skipped special tokens so far
        if window_text.endswith(_REPLACEMENT_CHAR) and not flush:
            return ""
        delta = window_text[len(self._prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self.token_ids)
        self._prefix_text = None
        self.text += delta
        return delta


@dataclass(frozen=True)
class StopStringCheck:
    """Result of `check_stop_strings`.

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

    Streaming use, per step: `text` is the detokenizer's `text`, `search_from` its length before
    this step's delta (earlier text was already searched); emit `text[emitted:check.end]`; stop
    the sequence if `check.stop` is set. A sequence that ends for another reason (EOS, length)
    emits all of `text`.

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
