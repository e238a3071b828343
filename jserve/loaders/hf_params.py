"""Turn HF-named weight tensors ([out, in] matrices) into the model's stacked parameter tree.

Both the safetensors and the GGUF loaders end here, so the mapping to the model's layout exists
once. The result is the pure dict `nnx.state(model, nnx.Param).to_pure_dict()` has.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from jserve.models.config import ModelConfig

Params = dict[str, object]  # nested dict of numpy arrays, same tree as the model's Param state


def expected_hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model needs, with its shape."""
    D, F, Hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q_out, kv_out = cfg.num_heads * Hd, cfg.num_kv_heads * Hd
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (cfg.vocab_size, D),
        "model.norm.weight": (D,),
    }
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, D)
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (q_out, D),
            p + "self_attn.k_proj.weight": (kv_out, D),
            p + "self_attn.v_proj.weight": (kv_out, D),
            p + "self_attn.o_proj.weight": (D, q_out),
            p + "mlp.gate_proj.weight": (F, D),
            p + "mlp.up_proj.weight": (F, D),
            p + "mlp.down_proj.weight": (D, F),
        }
        if cfg.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (q_out,),
                p + "self_attn.k_proj.bias": (kv_out,),
                p + "self_attn.v_proj.bias": (kv_out,),
            }
    return shapes


def params_from_hf(cfg: ModelConfig, get: Callable[[str], np.ndarray], source: str) -> Params:
    """Build the parameter tree; `get(name)` returns an HF tensor, `source` names the file(s).

    Raises ValueError naming the source and the tensor when one is missing or mis-shaped.
    """
    shapes = expected_hf_shapes(cfg)

    def t(name: str) -> np.ndarray:
        try:
            arr = np.asarray(get(name), dtype=np.float32)
        except KeyError:
            raise ValueError(f"{source}: tensor {name!r} is missing") from None
        if arr.shape != shapes[name]:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {arr.shape}, expected {shapes[name]}"
            )
        return arr

    L, D, Hd = cfg.num_layers, cfg.hidden_size, cfg.head_dim
    Hq, Hkv = cfg.num_heads, cfg.num_kv_heads

    def stack(suffix: str, transform: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        return np.stack([transform(t(f"model.layers.{i}.{suffix}")) for i in range(L)])

    layers = {
        "attn_norm": stack("input_layernorm.weight", lambda w: w),
        "mlp_norm": stack("post_attention_layernorm.weight", lambda w: w),
        "wq": stack("self_attn.q_proj.weight", lambda w: w.T.reshape(D, Hq, Hd)),
        "wk": stack("self_attn.k_proj.weight", lambda w: w.T.reshape(D, Hkv, Hd)),
        "wv": stack("self_attn.v_proj.weight", lambda w: w.T.reshape(D, Hkv, Hd)),
        "wo": stack("self_attn.o_proj.weight", lambda w: w.T.reshape(Hq, Hd, D)),
        "w_gate": stack("mlp.gate_proj.weight", lambda w: w.T),
        "w_up": stack("mlp.up_proj.weight", lambda w: w.T),
        "w_down": stack("mlp.down_proj.weight", lambda w: w.T),
    }
    if cfg.attention_bias:
        layers["bq"] = stack("self_attn.q_proj.bias", lambda b: b.reshape(Hq, Hd))
        layers["bk"] = stack("self_attn.k_proj.bias", lambda b: b.reshape(Hkv, Hd))
        layers["bv"] = stack("self_attn.v_proj.bias", lambda b: b.reshape(Hkv, Hd))
    params: Params = {
        "embed": t("model.embed_tokens.weight"),
        "final_norm": t("model.norm.weight"),
        "layers": layers,
    }
    if not cfg.tie_word_embeddings:
        params["lm_head"] = np.ascontiguousarray(t("lm_head.weight").T)
    return params
