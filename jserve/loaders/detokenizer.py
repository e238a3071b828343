"""Streaming text from token ids, one id at a time (stop strings: jserve.core.stopping).

Each step is `tokenizers`' `DecodeStream`: it decodes a short window of recent ids and emits
what the newest one adds, so a step costs the same however long the sequence is. Why a window:
one token can carry part of a UTF-8 character (byte-level BPE splits "😀" into three tokens),
and some decoders change the first token of a sequence (SentencePiece drops its leading space).
While the window's text ends in U+FFFD the last character may still be incomplete, so nothing
is emitted; once it ends in a whole character, text decoded from there on appends exactly to
what came before, which is why the pieces concatenate to `decode(all ids)`.

DecodeStream has no end: ids whose text never completes (a sequence that stops mid-character)
stay held. `finish` releases them, decoded after the window that last emitted text, as the
stream would have if they had completed.

One place where no stream can match `decode(all ids)`: with SentencePiece's byte fallback, a
run of byte tokens that is not valid UTF-8 decodes to one U+FFFD per token, so a byte that
already showed as a character turns into U+FFFD once an invalid byte follows it. DecodeStream
refuses such a window ("Invalid prefix"); the stream then restarts at that token, as vLLM's
does: the held bytes' U+FFFDs are dropped, and the token is decoded as a first one (without
its leading space). The hand-written detokenizer this replaced emitted misaligned text there
instead; everywhere else the two give the same pieces. (Byte-level BPE, every GGUF tokenizer's
kind, decodes invalid bytes without touching the text before them: this never happens there.)
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from jserve.loaders.tokenizer import Tokenizer

_INVALID_PREFIX = "Invalid prefix encountered"  # DecodeStream's error: see the module docstring


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text pieces, as they arrive.

    Call `add_token` with each new id, then `finish` once the sequence ends: it releases text
    held back because it ended in U+FFFD (e.g. a last token that stops mid-character for
    good). The pieces concatenate to `tokenizer.decode(ids, skip_special_tokens)`, except
    with `spaces_between_special_tokens` False (vLLM's rule for its fast detokenizer, which
    changes nothing unless special tokens are shown): an added token right after another is
    its bare content, without the space some decoders (WordPiece's) put before it.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        spaces_between_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._emitted: list[int] = []  # the ids of the last step that emitted text
        self._pending: list[int] = []  # ids since then: no text of theirs emitted yet
        spaced = skip_special_tokens or spaces_between_special_tokens
        self._added = None if spaced else tokenizer.added_tokens  # id -> content
        self._last_added = False

    def add_token(self, token_id: int) -> str:
        """Append an id; return the new text that is certain (possibly "")."""
        text = self._step(token_id)
        if self._added is not None:
            content = self._added.get(token_id)
            if content is not None and self._last_added:
                text = content
            self._last_added = content is not None
        return text

    def _step(self, token_id: int) -> str:
        self._pending.append(token_id)
        try:
            text = self._stream.step(self._tokenizer.backend, token_id)
        except Exception as e:  # the Rust side raises a bare Exception
            if not str(e).startswith(_INVALID_PREFIX):
                raise
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            self._emitted, self._pending = [], [token_id]
            text = self._stream.step(self._tokenizer.backend, token_id)
        if text is None:
            return ""
        self._emitted, self._pending = self._pending, []
        return text

    def finish(self) -> str:
        """Return whatever text is still held back; call once when the sequence ends."""
        if not self._pending:
            return ""
        before = self._decode(self._emitted)
        text = self._decode(self._emitted + self._pending)
        self._pending = []
        return text[len(before) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)
