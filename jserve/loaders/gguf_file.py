"""Read a GGUF file (llama.cpp's format): model config, and weights either dequantized to
float32 (`params_from_gguf`) or, for the native CPU kernel, kept in their quantized blocks,
fused and packed (`packed_params_from_gguf`; `unpackable` says when a file cannot be)."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np

from jserve.loaders.hf_params import Params, expected_hf_shapes, params_from_hf
from jserve.models.config import SUPPORTED_GGUF_ARCHITECTURES, ModelConfig
from jserve.models.llama import pack_block_projections
from jserve.pallas.quant_blocks import GGUF_FORMATS, BlockFormat, BlockMatrix, pack_weight

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


def _tensors(reader: gguf.GGUFReader) -> dict[str, gguf.ReaderTensor]:
    """The file's tensors the model reads, by HF name."""
    return {name: t for t in reader.tensors if (name := _hf_name(t.name)) is not None}


def _unpermuted(cfg: ModelConfig, name: str, rows: np.ndarray) -> np.ndarray:
    """A tensor's rows (output features first) with llama.cpp's Q/K interleave undone."""
    heads = {"q_proj": cfg.num_heads, "k_proj": cfg.num_kv_heads}.get(name.split(".")[-2])
    if cfg.architecture in ("llama", "mistral") and heads is not None:
        return _unpermute(rows, heads)
    return rows


def params_from_gguf(reader: gguf.GGUFReader, cfg: ModelConfig, source: str) -> Params:
    """Dequantize every tensor to float32 and map it onto the model's parameter tree."""
    tensors = _tensors(reader)

    def get(name: str) -> np.ndarray:
        t = tensors[name]
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(d) for d in reversed(t.shape)])  # GGUF lists dims innermost first
        return _unpermuted(cfg, name, w)

    return params_from_hf(cfg, get, source)


# The weights served packed (the layers' projections, the embedding, an untied output head), by
# the loader's name for them and their HF suffix.
_PACKED = {
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")


def _packed_names(cfg: ModelConfig) -> list[str]:
    names = ["model.embed_tokens.weight"]
    if not cfg.tie_word_embeddings:
        names.append("lm_head.weight")
    for i in range(cfg.num_layers):
        names += [f"model.layers.{i}.{suffix}" for suffix in _PACKED.values()]
    return names


def unpackable(reader: gguf.GGUFReader, cfg: ModelConfig) -> str | None:
    """Why the file's weights cannot be served as packed blocks, or None if they can: every
    projection, the embedding and an untied output head must be in a BlockFormat (a file with
    no quantized weight at all says so; other types are named)."""
    tensors = _tensors(reader)
    types = {name: tensors[name].tensor_type.name for name in _packed_names(cfg) if name in tensors}
    other = sorted({t for t in types.values() if t not in GGUF_FORMATS})
    if not other:
        return None
    if all(t in _FLOAT_TYPES for t in types.values()):
        return f"its weights are not quantized ({', '.join(other)})"
    example = next(tensors[name].name for name, t in types.items() if t in other)
    return (
        f"it holds {', '.join(other)} weights (e.g. {example}), which the packed kernel does not "
        f"read (it reads {', '.join(GGUF_FORMATS)})"
    )


def packed_params_from_gguf(reader: gguf.GGUFReader, cfg: ModelConfig, source: str) -> Params:
    """The model's parameter tree with the weights `unpackable` checks kept in their GGUF
    blocks, fused and packed for the native CPU kernel (uint8 arrays: jserve.pallas.quant_blocks);
    norms and biases as float32, biases unfused (place_model fuses them). Raises ValueError
    naming the tensor that is missing or mis-shaped, or a fused panel that would mix formats."""
    tensors, shapes = _tensors(reader), expected_hf_shapes(cfg)

    def tensor(name: str) -> gguf.ReaderTensor:
        if name not in tensors:
            raise ValueError(f"{source}: tensor {name!r} is missing")
        t = tensors[name]
        if tuple(int(d) for d in reversed(t.shape)) != shapes[name]:
            raise ValueError(f"{source}: tensor {name!r} has shape {t.shape[::-1]}, expected "
                             f"{shapes[name]}")  # fmt: skip
        return t

    def blocks(name: str) -> BlockMatrix:
        t = tensor(name)
        n, k = shapes[name]
        rows = _unpermuted(cfg, name, np.asarray(t.data).reshape(n, -1))
        return BlockMatrix(BlockFormat(t.tensor_type.name), rows, k)

    def floats(name: str) -> np.ndarray:  # a norm or a bias
        t = tensor(name)
        w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        return _unpermuted(cfg, name, w.reshape(shapes[name]))

    L = cfg.num_layers
    layer_blocks = [
        {short: blocks(f"model.layers.{i}.{suffix}") for short, suffix in _PACKED.items()}
        for i in range(L)
    ]
    try:
        layers = pack_block_projections(cfg, layer_blocks)
    except ValueError as e:
        raise ValueError(f"{source}: {e}") from None

    def stack(suffix: str) -> np.ndarray:
        return np.stack([floats(f"model.layers.{i}.{suffix}") for i in range(L)])

    layers |= {"attn_norm": stack("input_layernorm.weight"),
               "mlp_norm": stack("post_attention_layernorm.weight")}  # fmt: skip
    if cfg.attention_bias:
        for short, proj in (("bq", "q_proj"), ("bk", "k_proj"), ("bv", "v_proj")):
            layers[short] = stack(f"self_attn.{proj}.bias")
    params: Params = {
        "embed": pack_weight([[blocks("model.embed_tokens.weight")]]),
        "final_norm": floats("model.norm.weight"),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = pack_weight([[blocks("lm_head.weight")]])
    return params
