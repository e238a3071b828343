"""Incremental detokenization and stop strings, checked against a full decode / a direct search."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from jserve.loaders.detokenizer import IncrementalDetokenizer
from jserve.loaders.gguf_tokenizer import byte_to_unicode

REPLACEMENT = "\ufffd"


def byte_token(tokenizer, byte: int) -> int:
    """The id of the single-byte token for `byte`, or None if the vocabulary lacks it."""
    return tokenizer.token_to_id(byte_to_unicode()[byte])


@st.composite
def token_streams(draw, tokenizer):
    """Token ids mixing everything that makes streaming hard, cut into random chunks."""
    # SmolLM2's vocabulary lacks a few bytes (e.g. 0xC0, 0xF5-0xFF) that UTF-8 never uses.
    partial_utf8 = [i for b in range(0x80, 0x100) if (i := byte_token(tokenizer, b)) is not None]
    segment = st.one_of(
        st.lists(st.integers(0, tokenizer.vocab_size - 1), max_size=6),  # anything, specials too
        st.lists(st.sampled_from(partial_utf8), max_size=6),  # lone or broken UTF-8 bytes
        st.text(max_size=12).map(tokenizer.encode),  # real text: multi-byte chars split up
        st.lists(st.integers(0, 16), max_size=3),  # SmolLM2's control tokens
    )
    ids = [i for part in draw(st.lists(segment, max_size=8)) for i in part]
    chunks, start = [], 0
    while start < len(ids):
        size = draw(st.integers(1, 4))
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def check_stream(tokenizer, chunks, skip_special_tokens):
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    all_ids = [i for chunk in chunks for i in chunk]
    final = tokenizer.decode(all_ids, skip_special_tokens=skip_special_tokens)
    deltas, seen = [], []
    for chunk in chunks:
        deltas.append(detok.add_tokens(chunk))
        seen += chunk
        # Never emits what a later token could change (half a character): a prefix of the end.
        assert final.startswith(detok.text)
        # Holds back only while the text so far ends in U+FFFD.
        so_far = tokenizer.decode(seen, skip_special_tokens=skip_special_tokens)
        if not so_far.endswith(REPLACEMENT):
            assert detok.text == so_far
    deltas.append(detok.finish())
    assert "".join(deltas) == detok.text == final


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_concatenate_to_the_full_decode(data, skip_special_tokens, smollm2_tokenizer):
    chunks = data.draw(token_streams(smollm2_tokenizer))
    check_stream(smollm2_tokenizer, chunks, skip_special_tokens)


@pytest.mark.slow
@settings(max_examples=3000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), skip_special_tokens=st.booleans())
def test_deltas_concatenate_to_the_full_decode_long(data, skip_special_tokens, smollm2_tokenizer):
    chunks = data.draw(token_streams(smollm2_tokenizer))
    check_stream(smollm2_tokenizer, chunks, skip_special_tokens)


def test_character_split_over_byte_tokens_is_held_until_complete(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    pieces = [byte_token(smollm2_tokenizer, b) for b in "a😀".encode()]
    assert [detok.add_tokens([i]) for i in pieces] == ["a", "", "", "", "😀"]
    assert detok.finish() == ""


def test_finish_releases_a_broken_last_character(smollm2_tokenizer):
    detok = IncrementalDetokenizer(smollm2_tokenizer)
    pieces = [byte_token(smollm2_tokenizer, b) for b in b"ok\xe4\xbd"]
    assert [detok.add_tokens([i]) for i in pieces] == ["o", "k", "", ""]
    assert detok.finish() == REPLACEMENT


def test_special_tokens_follow_skip_special_tokens(smollm2_tokenizer):
    ids = smollm2_tokenizer.encode("Hi<|im_end|>")
    shown = IncrementalDetokenizer(smollm2_tokenizer, skip_special_tokens=False)
    hidden = IncrementalDetokenizer(smollm2_tokenizer)
    assert [shown.add_tokens([i]) for i in ids] == ["Hi", "<|im_end|>"]
    assert [hidden.add_tokens([i]) for i in ids] == ["Hi", ""]


def test_each_step_decodes_a_short_window(smollm2_tokenizer):
    """O(1) per token: the decode window does not grow with the sequence."""
    windows = []

    class SpyTokenizer:
        def decode(self, ids, skip_special_tokens=True):
            windows.append(len(ids))
            return smollm2_tokenizer.decode(ids, skip_special_tokens)

    text = "Streaming 你好 😀 text, " * 40
    detok = IncrementalDetokenizer(SpyTokenizer())
    for token_id in smollm2_tokenizer.encode(text):
        detok.add_tokens([token_id])
    assert detok.text + detok.finish() == text
    assert max(windows) <= 6
