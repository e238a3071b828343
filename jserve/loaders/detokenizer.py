"""Streaming text from token ids: incremental detokenization (stop strings: jserve.core.stopping).

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

from collections.abc import Iterable

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
