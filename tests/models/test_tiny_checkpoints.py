"""Tiny random checkpoints written by transformers: our logits must match theirs within 1e-4,
with the projections and output head on XLA's dot and on the native CPU kernel (whose packed
weight layout also changes how a tied embedding is looked up)."""

from __future__ import annotations

import json

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from jserve.layers.attention import DenseCausal
from jserve.loaders.safetensors_dir import load_safetensors_dir
from jserve.models.llama import lay_out_weights
from jserve.runtime.params import make_mesh, place_model

TOL = 1e-4
COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=256,
)
CASES = {
    "llama3-rope": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            **COMMON,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        )
    ),
    "llama-tied": lambda: transformers.LlamaForCausalLM(
        transformers.LlamaConfig(**COMMON, tie_word_embeddings=True)
    ),
    "qwen2-bias": lambda: transformers.Qwen2ForCausalLM(
        transformers.Qwen2Config(**COMMON, tie_word_embeddings=False)
    ),
    "mistral-window": lambda: transformers.MistralForCausalLM(
        transformers.MistralConfig(**COMMON, sliding_window=8)
    ),
}


def _write(name: str, path, **save_kwargs) -> torch.nn.Module:
    torch.manual_seed(sum(map(ord, name)))
    model = CASES[name]().eval()
    with torch.no_grad():  # random non-trivial norms and biases so every parameter matters
        for pname, p in model.named_parameters():
            if "norm" in pname or pname.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.5 + (1.0 if "norm" in pname else 0.0))
    model.save_pretrained(path, **save_kwargs)
    return model


def _jserve_logits(path, ids: np.ndarray, matmul_impl: str = "xla") -> np.ndarray:
    cfg, params = load_safetensors_dir(path)
    graphdef, state = place_model(cfg, params, jnp.float32, make_mesh())
    from flax import nnx

    model = nnx.merge(graphdef, lay_out_weights(state, matmul_impl))
    t = len(ids)
    logits, _, _ = model(
        jnp.asarray(ids), jnp.arange(t, dtype=jnp.int32), None, DenseCausal(), jnp.arange(t),
        matmul_impl,
    )  # fmt: skip
    return np.asarray(logits)


@pytest.mark.parametrize("matmul_impl", ["xla", "native"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_logits_match_transformers(name, matmul_impl, tmp_path):
    model = _write(name, tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, size=24).astype(np.int32)
    with torch.no_grad():
        expected = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    got = _jserve_logits(tmp_path, ids, matmul_impl)
    assert np.abs(got - expected).max() < TOL


def test_sharded_safetensors_index(tmp_path):
    model = _write("llama3-rope", tmp_path, max_shard_size="50KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    ids = np.arange(10, dtype=np.int32)
    with torch.no_grad():
        expected = model(torch.tensor(ids[None].astype(np.int64))).logits[0].numpy()
    assert np.abs(_jserve_logits(tmp_path, ids) - expected).max() < TOL


def _edit_single_file(path, edit) -> None:
    f = path / "model.safetensors"
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    _write("llama-tied", tmp_path)
    _edit_single_file(tmp_path, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*missing"):
        load_safetensors_dir(tmp_path)


def test_misshaped_tensor_names_shapes(tmp_path):
    _write("llama-tied", tmp_path)

    def edit(t):
        t["model.norm.weight"] = np.zeros(63, np.float32)

    _edit_single_file(tmp_path, edit)
    with pytest.raises(ValueError, match=r"model\.norm\.weight.*\(63,\).*\(64,\)"):
        load_safetensors_dir(tmp_path)


def test_unsupported_architecture_names_file(tmp_path):
    _write("llama-tied", tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*unsupported architecture.*GPT2"):
        load_safetensors_dir(tmp_path)


def test_directory_without_weights(tmp_path):
    _write("llama-tied", tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors"):
        load_safetensors_dir(tmp_path)
