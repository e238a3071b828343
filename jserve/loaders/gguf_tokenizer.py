"""Build a `tokenizers.Tokenizer` from the vocabulary a GGUF file stores in its metadata.

A GGUF carries no `tokenizer.json`: llama.cpp's converter writes the tokens, merges, token types
and special ids under `tokenizer.ggml.*`, and names the pre-tokenizer (the regex that splits text
before BPE) with a short id in `tokenizer.ggml.pre`. We rebuild the byte-level BPE from those and
map each supported pre-tokenizer id to the splitting its model was trained with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache
from typing import Any

import gguf
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer

# llama.cpp's token types (`llama_token_type`).
_CONTROL = 3
_USER_DEFINED = 4

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _byte_level(use_regex: bool) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)


def _regex_then_bytes(pattern: str) -> pre_tokenizers.PreTokenizer:
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(pattern), behavior="isolated"), _byte_level(use_regex=False)]
    )


def _smollm() -> pre_tokenizers.PreTokenizer:
    # What SmolLM2's own tokenizer.json does (and llama.cpp's "smollm": `\p{N}`, then GPT-2's
    # regex): every digit on its own, then GPT-2 splitting. Splitting digits first changes more
    # than digits: "a  1" becomes "a", "  ", "1" -> [a, ĠĠ, 1], not GPT-2's [a, Ġ, Ġ1 -> Ġ, 1].
    return pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), _byte_level(use_regex=True)]
    )


# `tokenizer.ggml.pre` -> the pre-tokenizer its model was trained with. Files written before
# llama.cpp recorded the field mean GPT-2 splitting ("default").
PRE_TOKENIZERS = {
    "default": lambda: _byte_level(use_regex=True),
    "gpt2": lambda: _byte_level(use_regex=True),
    "smollm": _smollm,
    "llama-bpe": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "llama3": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "llama-v3": lambda: _regex_then_bytes(_LLAMA3_SPLIT),
    "qwen2": lambda: _regex_then_bytes(_QWEN2_SPLIT),
}
# Llama 3 (and llama.cpp for these ids): a pre-token that is itself in the vocabulary is taken
# whole, without applying merges (`ignore_merges` in its tokenizer.json), and BOS is added unless
# the file says otherwise.
_LLAMA3_PRE_TOKENIZERS = frozenset({"llama-bpe", "llama3", "llama-v3"})


@cache
def byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters, in which byte-level BPE
    vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return mapping


@dataclass(frozen=True)
class GGUFTokenizerData:
    """What a GGUF says about its tokenizer, beyond the backend built from it."""

    backend: BackendTokenizer
    bos_token_id: int | None
    eos_token_id: int | None
    extra_stop_token_ids: tuple[int, ...]  # tokenizer.ggml.eot_token_id / eom_token_id
    chat_template: str | None


def gguf_path(reader: gguf.GGUFReader) -> str:
    """The file a reader was opened on (it keeps only the memory map), for error messages."""
    return str(getattr(reader.data, "filename", None) or "<GGUF file>")


def _field(reader: gguf.GGUFReader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


_ALPHABET_CHARS = frozenset(byte_to_unicode().values())


def _spell_in_byte_alphabet(token: str) -> str:
    # Most converters already spell every token in GPT-2's byte alphabet; some write plain UTF-8
    # (e.g. "  " or CJK user tokens). BPE only ever produces alphabet spellings, so respell.
    if all(ch in _ALPHABET_CHARS for ch in token):
        return token
    return "".join(byte_to_unicode()[b] for b in token.encode("utf-8"))


def build_gguf_tokenizer(reader: gguf.GGUFReader) -> GGUFTokenizerData:
    """The byte-level BPE tokenizer stored in a GGUF's metadata.

    Raises:
        ValueError: the file has no vocabulary, is not byte-level BPE (`tokenizer.ggml.model` !=
            "gpt2"), or names a pre-tokenizer we do not know how to reproduce.
    """
    path = gguf_path(reader)
    pre = _pre_tokenizer_id(reader, path)
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges: list[str] = _field(reader, "tokenizer.ggml.merges")
    if not tokens or not merges:
        raise ValueError(f"{path}: tokenizer.ggml.tokens or tokenizer.ggml.merges is missing")
    token_types: list[int] = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    backend = _bpe_backend(tokens, merges, token_types, pre, path)
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", pre in _LLAMA3_PRE_TOKENIZERS))
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
    post = _special_token_wrapper(
        tokens, bos_id if add_bos else None, eos_id if add_eos else None, path
    )
    if post is not None:
        backend.post_processor = post
    extra_stops = tuple(
        _field(reader, f"tokenizer.ggml.{name}_token_id")
        for name in ("eot", "eom")
        if _field(reader, f"tokenizer.ggml.{name}_token_id") is not None
    )
    return GGUFTokenizerData(
        backend=backend,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        extra_stop_token_ids=extra_stops,
        chat_template=_field(reader, "tokenizer.chat_template"),
    )


def _pre_tokenizer_id(reader: gguf.GGUFReader, path: str) -> str:
    """The file's pre-tokenizer id (`tokenizer.ggml.pre`), once its tokenizer is known to be
    byte-level BPE and the id one of PRE_TOKENIZERS; else a ValueError saying what to use."""
    model_kind = _field(reader, "tokenizer.ggml.model")
    if model_kind is None:
        raise ValueError(
            f"{path}: no tokenizer in the GGUF metadata (tokenizer.ggml.model missing)"
        )
    if model_kind != "gpt2":
        raise ValueError(
            f"{path}: tokenizer.ggml.model is {model_kind!r}; only byte-level BPE ('gpt2') GGUF "
            "tokenizers are supported. Use the model's HF directory (tokenizer.json) instead."
        )
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ValueError(
            f"{path}: unsupported pre-tokenizer tokenizer.ggml.pre={pre!r}; supported: "
            f"{sorted(PRE_TOKENIZERS)}. Use the model's HF directory (tokenizer.json) instead."
        )
    return pre


def _bpe_backend(
    tokens: list[str], merges: list[str], token_types: list[int], pre: str, path: str
) -> BackendTokenizer:
    """The byte-level BPE over the file's vocabulary and merges, split as pre-tokenizer `pre`
    splits, with its control tokens special and its user-defined tokens added."""
    # Control and user-defined tokens keep their literal text: the added-token matcher finds them
    # in the input by that text, and maps them to these ids through the vocabulary.
    literal = {_CONTROL, _USER_DEFINED}
    vocab = {
        (tok if kind in literal else _spell_in_byte_alphabet(tok)): i
        for i, (tok, kind) in enumerate(zip(tokens, token_types, strict=True))
    }
    if len(vocab) != len(tokens):
        raise ValueError(f"{path}: tokenizer.ggml.tokens has duplicate entries")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    try:
        bpe = models.BPE(
            vocab=vocab, merges=pairs, fuse_unk=False, ignore_merges=pre in _LLAMA3_PRE_TOKENIZERS
        )
    except Exception as err:  # the Rust side raises a bare Exception, e.g. a merge's unknown token
        raise ValueError(f"{path}: tokenizer.ggml.merges do not fit the vocabulary: {err}") from err
    backend = BackendTokenizer(bpe)
    backend.pre_tokenizer = PRE_TOKENIZERS[pre]()
    backend.decoder = decoders.ByteLevel()
    typed = list(zip(tokens, token_types, strict=True))
    backend.add_special_tokens([_added(t) for t, k in typed if k == _CONTROL])
    backend.add_tokens([_added(t, special=False) for t, k in typed if k == _USER_DEFINED])
    return backend


def _added(content: str, special: bool = True) -> AddedToken:
    return AddedToken(content, special=special, normalized=False)


def _special_token_wrapper(
    tokens: list[str], bos_id: int | None, eos_id: int | None, path: str
) -> processors.TemplateProcessing | None:
    """A post-processor adding BOS/EOS as the file asks (`tokenizer.ggml.add_bos_token`)."""
    if bos_id is None and eos_id is None:
        return None
    for name, token_id in (("bos", bos_id), ("eos", eos_id)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ValueError(f"{path}: tokenizer.ggml.{name}_token_id={token_id} is out of range")
    head = [tokens[bos_id]] if bos_id is not None else []
    tail = [tokens[eos_id]] if eos_id is not None else []
    single = [*head, "$A", *tail]
    pair = [*single, *head, "$B:1", *tail]
    specials = {tokens[i]: i for i in (bos_id, eos_id) if i is not None}
    return processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=list(specials.items())
    )
