"""Incremental detokenization (DecodeStream), checked against decoding every prefix of the ids."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models

from jserve.loaders.detokenizer import IncrementalDetokenizer
from jserve.loaders.gguf_tokenizer import byte_to_unicode
from jserve.loaders.tokenizer import Tokenizer
from tests.budgets import THOROUGH, examples

REPLACEMENT = "\ufffd"


def byte_token(tokenizer, byte: int) -> int:
    """The id of the single-byte token for `byte`, or None if the vocabulary lacks it."""
    return tokenizer.backend.token_to_id(byte_to_unicode()[byte])


@st.composite
def token_ids(draw, tokenizer):
    """Token ids mixing everything that makes streaming hard."""
    # SmolLM2's vocabulary lacks a few bytes (e.g. 0xC0, 0xF5-0xFF) that UTF-8 never uses.
    partial_utf8 = [i for b in range(0x80, 0x100) if (i := byte_token(tokenizer, b)) is not None]
    segment = st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=6),  # anything, specials too
        st.lists(st.sampled_from(partial_utf8), max_size=6),  # lone or broken UTF-8 bytes
        st.text(max_size=12).map(tokenizer.encode),  # real text: multi-byte chars split up
        st.lists(st.integers(0, 16), max_size=3),  # SmolLM2's control tokens
    )
    return [i for part in draw(st.lists(segment, max_size=8)) for i in part]


def check_stream(tokenizer, ids, skip_special_tokens):
    """The detokenizer's contract, at every step: it shows decode(ids so far) unless that ends
    in U+FFFD (a character may be incomplete), never what a later id could change, and its
    pieces with `finish` concatenate to decode(all ids). Returns the pieces."""
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    final = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    pieces, text = [], ""
    for n, token_id in enumerate(ids, 1):
        pieces.append(detok.add_token(token_id))
        text += pieces[-1]
        assert final.startswith(text)
        so_far = tokenizer.decode(ids[:n], skip_special_tokens=skip_special_tokens)
        if not so_far.endswith(REPLACEMENT):
            assert text == so_far
    pieces.append(detok.finish())
    assert "".join(pieces) == final
    return pieces


@examples(150)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_pieces_concatenate_to_the_full_decode(data, skip_special_tokens, smollm2_tokenizer):
    ids = data.draw(token_ids(smollm2_tokenizer))
    check_stream(smollm2_tokenizer, ids, skip_special_tokens)


@pytest.mark.slow
@examples(300, THOROUGH)
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_pieces_concatenate_to_the_full_decode_long(data, skip_special_tokens, smollm2_tokenizer):
    """The thorough budget: test_pieces_concatenate_to_the_full_decode covers it by default."""
    ids = data.draw(token_ids(smollm2_tokenizer))
    check_stream(smollm2_tokenizer, ids, skip_special_tokens)


@pytest.mark.parametrize(
    "text",
    [
        "Plain ASCII, punctuation; and\n\tspacing  twice.",
        "Numbers 1234567890, -3.14e-10, 0x1F",
        "中文文本，日本語のテキスト、한국어",
        "Emoji 😀👍🏽🇫🇷 👨‍👩‍👧 split across byte tokens",
        "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    ],
)
@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_named_kinds_of_text(text, skip_special_tokens, smollm2_tokenizer):
    check_stream(smollm2_tokenizer, smollm2_tokenizer.encode(text), skip_special_tokens)


def test_random_ids(smollm2_tokenizer):
    rng = random.Random(5)
    for _ in range(300):
        ids = [rng.randrange(smollm2_tokenizer.vocab_size) for _ in range(rng.randint(1, 12))]
        check_stream(smollm2_tokenizer, ids, rng.random() < 0.5)


def test_character_split_over_byte_tokens_is_held_until_complete(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    pieces = [byte_token(smollm2_tokenizer, b) for b in "a😀".encode()]
    assert [detok.add_token(i) for i in pieces] == ["a", "", "", "", "😀"]
    assert detok.finish() == ""


def test_finish_releases_a_broken_last_character(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    pieces = [byte_token(smollm2_tokenizer, b) for b in b"ok\xe4\xbd"]
    assert [detok.add_token(i) for i in pieces] == ["o", "k", "", ""]
    assert detok.finish() == REPLACEMENT


def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi<|im_end|>")
    shown = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=False)
    hidden = IncrementalDetokenizer(smollm2_tokenizer)
    assert [shown.add_token(i) for i in ids] == ["Hi", "<|im_end|>"]
    assert [hidden.add_token(i) for i in ids] == ["Hi", ""]


def test_finish_decodes_only_the_last_window(smollm2_tokenizer):
    """O(1) at the end too: finish decodes the ids since the last piece and the step before."""
    windows = []

    class SpyTokenizer(Tokenizer):
        def decode(self, ids, skip_special_tokens=True):
            windows.append(len(ids))
            return super().decode(ids, skip_special_tokens)

    spy = SpyTokenizer(
        smollm2_tokenizer.backend, bos_token_id=None, eos_token_id=None, chat_template=None,
        source="spy",
    )  # fmt: skip
    detok = IncrementalDetokenizer(spy)
    text = "Streaming 你好 😀 text, " * 40
    ids = [*smollm2_tokenizer.encode(text), byte_token(smollm2_tokenizer, 0xE4)]
    assert "".join(detok.add_token(i) for i in ids) == text
    assert detok.finish() == REPLACEMENT
    assert windows and max(windows) <= 3


def sentencepiece_byte_fallback() -> Tokenizer:
    """Llama 2's decoder over a vocabulary of <unk>, the 256 byte tokens and two words."""
    vocab = {"<unk>": 0, **{f"<0x{b:02X}>": 1 + b for b in range(256)}, "▁Hello": 257}
    backend = BackendTokenizer(models.BPE(vocab, [], byte_fallback=True, unk_token="<unk>"))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
         decoders.Strip(" ", 1, 0)]
    )  # fmt: skip
    return Tokenizer(backend, bos_token_id=None, eos_token_id=None, chat_template=None, source="")


def test_sentencepiece_bytes_that_rewrite_earlier_text_restart_the_stream():
    """',' then byte 0xC9: decode() turns both into U+FFFD (one per byte token), rewriting
    the ',' already shown. DecodeStream refuses that; the stream restarts at the next token."""
    tokenizer = sentencepiece_byte_fallback()
    comma, lead_byte, hello = 1 + ord(","), 1 + 0xC9, 257
    assert tokenizer.decode([comma, lead_byte, hello]) == "\ufffd\ufffd Hello"
    detok = IncrementalDetokenizer(tokenizer)
    assert [detok.add_token(i) for i in [comma, lead_byte, hello, hello]] == [
        ",", "", "Hello", " Hello",
    ]  # fmt: skip
    assert detok.finish() == ""
    ids = [hello, 1 + 0xC3, 1 + 0xA9, hello]  # valid bytes: "é" as two byte tokens
    assert check_stream(tokenizer, ids, True) == ["Hello", "", "é", " Hello", ""]


def _wordpiece_tokenizer() -> Tokenizer:
    """A decoder that puts a space between special tokens (WordPiece's), unlike SmolLM2's."""
    from tokenizers import AddedToken, pre_tokenizers

    backend = BackendTokenizer(
        models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]")
    )
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken("<x>", special=True), AddedToken("<y>", special=True)])
    return Tokenizer(
        backend, bos_token_id=None, eos_token_id=None, chat_template=None, source="wordpiece"
    )


@pytest.mark.parametrize(
    ("skip", "spaces", "pieces"),
    [
        (False, True, ["hello", " <x>", " <y>", " world", "s", " <y>"]),  # DecodeStream's own
        (False, False, ["hello", " <x>", "<y>", " world", "s", " <y>"]),  # <y> right after <x>
        (True, False, ["hello", "", "", " world", "s", ""]),  # specials hidden: nothing to join
    ],
)
def test_spaces_between_special_tokens_false_joins_consecutive_ones_as_vllm(skip, spaces, pieces):
    """vLLM's fast-detokenizer rule: with special tokens shown and spaces between them off, an
    added token right after another is its bare content."""
    tokenizer = _wordpiece_tokenizer()
    x, y = tokenizer.backend.token_to_id("<x>"), tokenizer.backend.token_to_id("<y>")
    detok = IncrementalDetokenizer(tokenizer, skip, spaces)
    assert [detok.add_token(i) for i in [1, x, y, 2, 3, y]] + [detok.finish()] == [*pieces, ""]
