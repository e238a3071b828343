"""A GGUF served packed (jserve.loaders.gguf_file.packed_params_from_gguf) against the same file
dequantized: a tiny Llama written here as a Q4_K_M file is (Q4_K projections, some layers'
attn_v and ffn_down in Q6_K, a Q8_0 embedding, an untied Q6_K head, a vocabulary that is not a
multiple of the 16-column panel) must give the same logits, bit for bit, on the native CPU
kernels; the packed conversion is cached; a file with a type the kernel cannot read, or whose
fused projection would mix two types in a panel, loads dequantized with one warning."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jserve.layers.attention import DenseCausal
from jserve.loaders.gguf_tokenizer import byte_to_unicode
from jserve.loaders.model_source import load_model
from jserve.models.llama import lay_out_weights
from jserve.pallas import native_build
from jserve.pallas.quant_blocks import BlockFormat
from jserve.runtime.params import make_mesh, place_model
from tests.pallas.quant_cases import random_blocks

D, F, HEADS, KV_HEADS, LAYERS = 256, 512, 4, 2, 2
VOCAB = 2 + 256 + 1  # two control tokens, the byte tokens and one merge
# tensor -> its type in each layer, as llama.cpp's Q4_K_M mixes them
TYPES = {
    "attn_q": ("Q4_K", "Q4_K"),
    "attn_k": ("Q4_K", "Q4_K"),
    "attn_v": ("Q6_K", "Q4_K"),
    "attn_output": ("Q4_K", "Q4_K"),
    "ffn_gate": ("Q4_K", "Q4_K"),
    "ffn_up": ("Q4_K", "Q4_K"),
    "ffn_down": ("Q4_K", "Q6_K"),
}
SHAPES = {  # [N, K]: GGUF's rows are output features
    "attn_q": (D, D), "attn_k": (D // 2, D), "attn_v": (D // 2, D), "attn_output": (D, D),
    "ffn_gate": (F, D), "ffn_up": (F, D), "ffn_down": (D, F),
}  # fmt: skip


def write_gguf(path: Path, types: dict[str, tuple[str, ...]] = TYPES) -> Path:
    rng = np.random.default_rng(0)
    writer = gguf.GGUFWriter(path, arch="llama")
    writer.add_embedding_length(D)
    writer.add_feed_forward_length(F)
    writer.add_block_count(LAYERS)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_context_length(256)
    alphabet = byte_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(["<s>", "</s>", *(alphabet[b] for b in range(256)), "he"])
    writer.add_token_merges(["h e"])
    writer.add_token_types([3, 3] + [1] * 257)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)

    def blocks(name: str, kind: str, n: int, k: int) -> None:
        ggml = gguf.GGMLQuantizationType[kind]
        if kind in tuple(BlockFormat):
            rows = random_blocks(BlockFormat(kind), n, k, rng).rows
        else:  # random bytes: loaded, never multiplied here
            block, size = gguf.GGML_QUANT_SIZES[ggml]
            rows = rng.integers(0, 256, (n, k // block * size), dtype=np.uint8)
        writer.add_tensor(name, rows, raw_dtype=ggml)

    def norm(name: str) -> None:
        writer.add_tensor(name, (1 + 0.1 * rng.standard_normal(D)).astype(np.float32))

    blocks("token_embd.weight", "Q8_0", VOCAB, D)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        norm(f"blk.{i}.ffn_norm.weight")
        for name, kinds in types.items():
            blocks(f"blk.{i}.{name}.weight", kinds[i], *SHAPES[name])
    norm("output_norm.weight")
    blocks("output.weight", "Q6_K", VOCAB, D)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _logits(loaded, ids: np.ndarray) -> np.ndarray:
    graphdef, state = place_model(loaded.config, loaded.params, jnp.float32, make_mesh())
    model = nnx.merge(graphdef, lay_out_weights(state, "native"))
    t = len(ids)
    logits, _, _ = model(
        jnp.asarray(ids), jnp.arange(t, dtype=jnp.int32), None, DenseCausal(), jnp.arange(t),
        "native",
    )  # fmt: skip
    return np.asarray(logits)


def test_packed_blocks_give_the_dequantized_logits_bit_for_bit(tmp_path):
    if native_build.load() is None:
        pytest.skip("the native CPU kernels cannot be built here (see the log)")
    path = write_gguf(tmp_path / "tiny-q4_k_m.gguf")
    packed = load_model(path, cache_dir=tmp_path, packed=True)
    plain = load_model(path, cache_dir=tmp_path)
    assert packed.quantization == "gguf:Q4_K,Q6_K,Q8_0"
    assert plain.quantization == "none"
    assert packed.params["layers"]["wqkv"].dtype == np.uint8
    ids = np.random.default_rng(1).integers(0, VOCAB, 20).astype(np.int32)
    got, expected = _logits(packed, ids), _logits(plain, ids)
    assert np.abs(expected).max() > 0.1  # the random model says something
    np.testing.assert_array_equal(got, expected)
    cached = load_model(path, cache_dir=tmp_path, packed=True)  # from the packed cache entry
    np.testing.assert_array_equal(cached.params["embed"], packed.params["embed"])


def test_a_type_the_kernel_cannot_read_loads_dequantized_with_a_warning(tmp_path, caplog):
    types = {**TYPES, "ffn_down": ("Q4_K", "Q5_K")}
    path = write_gguf(tmp_path / "tiny-q5.gguf", types)
    for _ in range(2):  # the second load learns why from the cache, without parsing the file
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            loaded = load_model(path, cache_dir=tmp_path, packed=True)
        assert loaded.quantization == "none"
        [record] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert "Q5_K" in record.getMessage() and "blk.1.ffn_down" in record.getMessage()


def test_gate_and_up_of_two_types_load_dequantized(tmp_path, caplog):
    """Gate and up are interleaved column by column, so their types would share a panel."""
    types = {**TYPES, "ffn_up": ("Q4_K", "Q6_K")}
    path = write_gguf(tmp_path / "tiny-mixed.gguf", types)
    with caplog.at_level(logging.WARNING):
        assert load_model(path, cache_dir=tmp_path, packed=True).quantization == "none"
    assert "mix formats" in caplog.text
