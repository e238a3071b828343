"""Read a GGUF file (llama.cpp's format): model config and dequantized float32 weights."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jserve.loaders.hf_params import Params, params_from_hf
from jserve.models.config import SUPPORTED_GGUF_ARCHITECTURES, ModelConfig

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def open_gguf(path: str | Path) -> gguf.GGUFReader:
    """Open a GGUF file, turning low-level failures into errors that name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such GGUF file")
    try:
        return gguf.GGUFReader(path)
    except Exception as e:  # the reader raises bare ValueError/IndexError on damaged files
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt?): {e}") from e


def _field(reader: gguf.GGUFReader, key: str, default: object = None) -> object:
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def config_from_gguf(reader: gguf.GGUFReader, source: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(
            f"{source}: unsupported architecture {arch!r}; jserve supports "
            f"{list(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    if any(t.name == "rope_freqs.weight" for t in reader.tensors):
        raise ValueError(
            f"{source}: GGUF rope scaling factors (rope_freqs.weight) are not supported; "
            "load the model's HF safetensors directory instead"
        )

    def need(key: str) -> object:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{source}: metadata key {arch}.{key} is missing")
        return value

    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = _field(reader, f"{arch}.vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        architecture=str(arch),
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(need("feed_forward_length")),
        num_layers=int(need("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        head_dim=int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads)),
        rope_theta=float(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        rms_norm_eps=float(need("attention.layer_norm_rms_epsilon")),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        max_position_embeddings=int(_field(reader, f"{arch}.context_length", 2048)),
        sliding_window=_field(reader, f"{arch}.attention.sliding_window"),
    )


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".")  # blk.{i}.{name}.{weight|bias}
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's converter, which interleaves Q/K rows for its RoPE; works on [out, ...]."""
    out = w.shape[0]
    rest = w.shape[1:]
    return w.reshape(n_heads, out // n_heads // 2, 2, *rest).swapaxes(1, 2).reshape(out, *rest)


def params_from_gguf(reader: gguf.GGUFReader, cfg: ModelConfig, source: str) -> Params:
    """Dequantize every tensor to float32 and map it onto the model's parameter tree."""
    tensors = {}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is not None:
            tensors[name] = t
    permute_heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        proj = name.split(".")[-2]
        if cfg.architecture in ("llama", "mistral") and proj in permute_heads:
            w = _unpermute(w, permute_heads[proj])
        return w

    return params_from_hf(cfg, get, source)
