"""vLLM's bad_words as token sequences: which ids each output bans next."""

from __future__ import annotations

from jserve.core.bad_words import NO_BAD_WORDS, BadWords

# A word-level toy tokenizer: a word alone and after a space are different tokens.
VOCAB = {"bad": 5, " bad": 6, "word": 7, " word": 8, "x": 9, " x": 9}


def encode(text: str) -> list[int]:
    ids, rest = [], text
    while rest:
        piece = next(p for p in sorted(VOCAB, key=len, reverse=True) if rest.startswith(p))
        ids.append(VOCAB[piece])
        rest = rest[len(piece) :]
    return ids


def test_each_word_and_its_spaced_form_when_it_is_another_token_run():
    words = BadWords.from_words(["bad", " bad word", "x"], encode)
    # "x" and " x" are one token: the spaced form adds nothing; " bad word" is stripped first.
    assert words.sequences == ((5,), (6,), (5, 8), (6, 8), (9,))


def test_a_sequences_last_token_is_banned_after_the_rest_of_it():
    words = BadWords(((5,), (5, 8), (6, 7, 8)))
    assert words.banned([]) == [5]  # one-token words always; longer ones need their prefix
    assert words.banned([1, 5]) == [5, 8]
    assert words.banned([6, 7]) == [5, 8]
    assert words.banned([6]) == [5]
    assert words.banned([7, 6, 7, 1]) == [5]
    assert NO_BAD_WORDS.banned([5, 6, 7]) == []
