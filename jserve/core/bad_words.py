"""vLLM's `bad_words`: words a request must not generate, as token sequences whose last token
is banned whenever the output so far ends with the rest of the sequence.

Each word is tokenized twice, as it stands and after a space (a word mid-text is usually its
own token run with a leading space), and the spaced form is kept only where it is a different
run of the same length, as vLLM does. A one-token sequence is banned at every step. Only the
request's output is matched, not its prompt (vLLM's rule): a word cut across the prompt and
the first output token is not caught.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class BadWords:
    """A request's bad words as token sequences (`from_words`)."""

    sequences: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def from_words(cls, words: Sequence[str], encode: Callable[[str], list[int]]) -> BadWords:
        """The sequences of `words` under `encode` (text -> ids, no special tokens)."""
        sequences: list[tuple[int, ...]] = []
        for word in words:
            plain = tuple(encode(word.lstrip()))
            spaced = tuple(encode(" " + word.lstrip()))
            if plain:
                sequences.append(plain)
            if spaced and len(spaced) == len(plain) and spaced[0] != plain[0]:
                sequences.append(spaced)
        return cls(tuple(dict.fromkeys(sequences)))

    def banned(self, output: Sequence[int]) -> list[int]:
        """Ids the next token must not be, after `output`: each sequence's last id where the
        output ends with the ids before it."""
        n = len(output)
        return [
            seq[-1]
            for seq in self.sequences
            if len(seq) - 1 <= n
            and all(output[n - len(seq) + 1 + j] == t for j, t in enumerate(seq[:-1]))
        ]


NO_BAD_WORDS = BadWords()  # a request without bad words
