"""Fixtures for the tokenizer tests: SmolLM2's GGUF read once, transformers' tokenizer as the
oracle, and tiny GGUF vocabularies written on the spot for the other pre-tokenizers."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import gguf
import pytest

from jserve.loaders.gguf_tokenizer import byte_to_unicode
from jserve.loaders.tokenizer import Tokenizer


@pytest.fixture(scope="session")
def smollm2_gguf(default_gguf: Path) -> Path:
    return default_gguf


@pytest.fixture(scope="session")
def smollm2_reader(smollm2_gguf: Path) -> gguf.GGUFReader:
    """Parsing the GGUF takes seconds: once per session."""
    return gguf.GGUFReader(smollm2_gguf)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_reader: gguf.GGUFReader) -> Tokenizer:
    return Tokenizer.from_gguf_reader(smollm2_reader)


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(smollm2_gguf: Path):
    """transformers' tokenizer from the same GGUF, exactly as transformers builds it."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(
        smollm2_gguf.parent, gguf_file=smollm2_gguf.name
    )


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(hf_gguf_tokenizer):
    """transformers' GGUF tokenizer with SmolLM2's real pre-tokenizer.

    transformers has no entry for tokenizer.ggml.pre = "smollm" and falls back to plain GPT-2
    splitting. SmolLM2's own tokenizer.json (and llama.cpp's "smollm") split every digit first,
    which differs on whitespace runs before a digit ("a  1"). Everything else (vocabulary,
    merges, special tokens, decoder, template) stays transformers' own.
    """
    from tokenizers import pre_tokenizers

    fixed = copy.deepcopy(hf_gguf_tokenizer)
    fixed.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return fixed


# A byte-level vocabulary small enough to write in milliseconds: two control tokens, the 256
# byte tokens, and the tokens these merges make.
TINY_MERGES = ["h e", "l l", "he ll", "hell o", "Ġ hello", "1 2", "12 3", "Ġ Ġ", "Ċ Ċ"]
UNMERGEABLE = "Ġworld"  # in the vocabulary, but no merge makes it
TINY_TEMPLATE = (
    "{% for m in messages %}{{ bos_token + m['role'] + ': ' + m['content'] + eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}"
)


@pytest.fixture
def write_tiny_gguf(tmp_path: Path) -> Callable[..., Path]:
    """Write a GGUF holding only a tiny tokenizer; keyword arguments set its metadata
    (`add_bos=None` leaves tokenizer.ggml.add_bos_token out)."""

    def write(pre: str = "llama-bpe", model: str = "gpt2", add_bos: bool | None = True) -> Path:
        alphabet = byte_to_unicode()
        tokens = ["<s>", "</s>", *(alphabet[b] for b in range(256))]
        tokens += [m.replace(" ", "") for m in TINY_MERGES] + [UNMERGEABLE]
        path = tmp_path / f"tiny-{pre}-{model}.gguf"
        writer = gguf.GGUFWriter(path, arch="llama")
        writer.add_tokenizer_model(model)
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_merges(TINY_MERGES)
        writer.add_token_types([3, 3] + [1] * (len(tokens) - 2))
        writer.add_bos_token_id(0)
        writer.add_eos_token_id(1)
        if add_bos is not None:
            writer.add_add_bos_token(add_bos)
        writer.add_chat_template(TINY_TEMPLATE)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        return path

    return write
