"""Checkpoint round trips, the GGUF cache, and clear errors for bad model files."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jserve.loaders.checkpoint_dir import restore_params
from jserve.loaders.gguf_file import open_gguf
from jserve.loaders.model_source import load_model


def _flat(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


@pytest.fixture(scope="module")
def through_the_cache(default_gguf, tmp_path_factory):
    """The default GGUF loaded twice through an empty cache: (the first load, which reads the
    GGUF and converts it into the cache; the second, from the cache's checkpoint; the cache
    directory). One conversion serves the round-trip, equality and reuse tests."""
    cache = tmp_path_factory.mktemp("cache")
    first = load_model(default_gguf, cache_dir=cache)
    return first, load_model(default_gguf, cache_dir=cache), cache


def test_orbax_round_trip_is_bit_exact(through_the_cache):
    direct, _, cache = through_the_cache
    (entry,) = (cache / "models").iterdir()
    restored = _flat(restore_params(entry))
    original = _flat(direct.params)
    assert restored.keys() == original.keys()
    for name, value in original.items():
        assert restored[name].dtype == value.dtype and np.array_equal(restored[name], value), name


def test_gguf_and_checkpoint_give_identical_params(through_the_cache):
    """GGUF -> orbax -> load is the same model: same config, same tokenizer, bit-equal weights."""
    direct, via_ckpt, _ = through_the_cache
    assert via_ckpt.config == direct.config
    text = "<|im_start|>user\nHello 123 世界<|im_end|>\n"
    assert via_ckpt.tokenizer.encode(text) == direct.tokenizer.encode(text)
    assert via_ckpt.tokenizer.chat_template == direct.tokenizer.chat_template
    a, b = _flat(direct.params), _flat(via_ckpt.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_default_model_cache_is_reused(through_the_cache, default_gguf):
    first, second, cache = through_the_cache
    assert first.source == default_gguf  # converted from the GGUF...
    entries = list((cache / "models").iterdir())
    assert len(entries) == 1 and (entries[0] / "params").is_dir()
    assert second.source == entries[0]  # ...then served from the cache, not the GGUF
    assert first.config == second.config


def test_missing_path_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf"):
        load_model(tmp_path / "nope.gguf")


def test_truncated_gguf_is_named(default_gguf, tmp_path):
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(default_gguf.read_bytes()[:1_000_000])
    with pytest.raises(ValueError, match=r"broken\.gguf.*truncated or corrupt"):
        open_gguf(broken)


def test_not_a_gguf_is_named(tmp_path):
    bogus = tmp_path / "bogus.gguf"
    bogus.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match=r"bogus\.gguf"):
        open_gguf(bogus)


def test_unknown_file_type(tmp_path):
    f = tmp_path / "weights.bin"
    f.write_bytes(b"\0")
    with pytest.raises(ValueError, match=r"weights\.bin.*expected a \.gguf file"):
        load_model(f)
