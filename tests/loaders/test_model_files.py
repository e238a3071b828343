"""Checkpoint round trips, the GGUF cache, and clear errors for bad model files."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jserve.loaders.checkpoint_dir import restore_params, save_checkpoint
from jserve.loaders.gguf_file import open_gguf
from jserve.loaders.model_source import load_model


def _flat(tree) -> dict[str, np.ndarray]:
    return {
        jax.tree_util.keystr(k): np.asarray(v) for k, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def test_orbax_round_trip_is_bit_exact(default_model, tmp_path):
    save_checkpoint(
        tmp_path / "ckpt", default_model.config, default_model.params, default_model.tokenizer
    )
    restored = _flat(restore_params(tmp_path / "ckpt"))
    original = _flat(default_model.params)
    assert restored.keys() == original.keys()
    for name, value in original.items():
        assert restored[name].dtype == value.dtype and np.array_equal(restored[name], value), name


def test_gguf_and_checkpoint_give_identical_params(default_gguf, tmp_path):
    """GGUF -> orbax -> load is the same model: same config, same tokenizer, bit-equal weights."""
    direct = load_model(default_gguf, use_cache=False)
    save_checkpoint(tmp_path / "c", direct.config, direct.params, direct.tokenizer)
    via_ckpt = load_model(tmp_path / "c")
    assert via_ckpt.config == direct.config
    text = "<|im_start|>user\nHello 123 世界<|im_end|>\n"
    assert via_ckpt.tokenizer.encode(text) == direct.tokenizer.encode(text)
    assert via_ckpt.tokenizer.chat_template == direct.tokenizer.chat_template
    a, b = _flat(direct.params), _flat(via_ckpt.params)
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_default_model_cache_is_reused(default_model, default_gguf, tmp_path):
    first = load_model(default_gguf, cache_dir=tmp_path)
    entries = list((tmp_path / "models").iterdir())
    assert len(entries) == 1 and (entries[0] / "params").is_dir()
    second = load_model(default_gguf, cache_dir=tmp_path)
    assert second.source == entries[0]  # served from the cache, not the GGUF
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
