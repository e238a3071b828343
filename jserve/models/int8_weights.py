"""--quantization int8: a float checkpoint's matmul weights as symmetric per-output-channel int8
with float scales, quantized once at load by qwix (absmax: a column's scale is its largest
magnitude / 127.5, qwix's symmetric int8 bound, its quants round(w / scale) in [-128, 127]: every
weight within half a step).

Which weights: the four projections of every layer (`wqkv`, `wo`, `w_gate_up`, `w_down`, fused
first, so a fused column keeps the scale of the column it was) and the output head (the
embedding, when tied: the lookup then reads the int8 table). Norms, biases and an untied
embedding (a lookup, not a matmul) stay float.

The same numbers (q, scale) take one of two layouts, by where the projections run
(jserve.pallas.layer_matmul):
- "native" (CPU, float32): packed as INT8 panels (jserve.pallas.quant_blocks: each group of 16
  k of a column holds the column's float32 scale), uint8 arrays like a GGUF's packed blocks,
  multiplied by native/quant_matmul_cpu.cc, which makes each weight `scale * q` in float32 in
  registers;
- "xla" (TPU, GPU, a model split over devices): q as int8 arrays of the parameters' own shapes
  and the scales beside them (`NAME_scale`, one per output column, declared by
  `LlamaModel(..., int8_weights=True)`); qwix's dot_general converts q inside the dot, which
  XLA fuses, and scales the columns.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np
import qwix

from jserve.models.config import ModelConfig
from jserve.models.llama import PROJECTIONS, fuse_projections
from jserve.pallas.quant_blocks import (
    LAYOUTS,
    BlockFormat,
    BlockMatrix,
    pack_weight,
    packed_bytes,
)

INT8 = "int8"  # what LoadedModel.quantization reports for these weights
SCALE = "_scale"  # NAME + SCALE: the scales of int8 parameter NAME ("xla" layout)
_UNFUSED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


def quantize_channels(w: Any) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K, N] float -> (q int8 [..., K, N], scale float32 [..., N]), symmetric per output
    column (and per leading index: a layer), by qwix: |w - q * scale| <= scale / 2."""
    w = jnp.asarray(w, jnp.float32)
    channels = (*range(w.ndim - 2), w.ndim - 1)
    quantized = qwix.quantize(w, jnp.int8, channelwise_axes=channels)
    return np.asarray(quantized.qvalue), np.asarray(quantized.scale)[..., 0, :]


def int8_blocks(q: np.ndarray, scale: np.ndarray) -> BlockMatrix:
    """One weight's q [K, N] and scale [N] as INT8 blocks: N rows of K / 16 blocks, each the
    column's float32 scale and 16 quants."""
    k, n = q.shape
    block = LAYOUTS[BlockFormat.INT8].block
    if k % block:
        raise ValueError(
            f"--quantization int8 on the native CPU kernel needs every matmul's input size "
            f"(K) to be a multiple of {block}; a weight has K={k}"
        )
    rows = np.empty((n, k // block, 4 + block), np.uint8)
    rows[..., :4] = np.asarray(scale, "<f4").view(np.uint8).reshape(n, 1, 4)
    rows[..., 4:] = np.ascontiguousarray(q.T).reshape(n, k // block, block).view(np.uint8)
    return BlockMatrix(BlockFormat.INT8, rows.reshape(n, -1), k)


def int8_matrix_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int, int]]:
    """(layers, K, N) of each weight int8 quantizes, as the matmuls read it."""
    L, D, F, V = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    Hq, Hkv, Hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    return {
        "wqkv": (L, D, (Hq + 2 * Hkv) * Hd),
        "wo": (L, Hq * Hd, D),
        "w_gate_up": (L, D, 2 * F),
        "w_down": (L, F, D),
        head: (1, D, V),
    }


def packed_int8_bytes(cfg: ModelConfig) -> dict[str, int]:
    """Each packed int8 weight's size in bytes ("native" layout): what `int8_params` makes,
    known from the config alone (jserve compile)."""
    return {
        name: packed_bytes(BlockFormat.INT8, *shape)
        for name, shape in int8_matrix_shapes(cfg).items()
    }


def int8_params(cfg: ModelConfig, params: dict[str, Any], packed: bool) -> dict[str, Any]:
    """A loader's float parameter tree with its matmul weights quantized (module docstring):
    `packed` for the native CPU kernel, else the "xla" layout (int8 and `NAME_scale` arrays).
    The projections come out fused; the biases stay unfused for `fuse_projections`."""
    layers = params["layers"]
    fused = fuse_projections(cfg, layers)
    out_layers = {name: w for name, w in layers.items() if name not in _UNFUSED}
    for name in PROJECTIONS:
        w = np.asarray(fused[name])
        q, scale = quantize_channels(w.reshape(w.shape[0], -1, w.shape[-1]))  # [L, K, N]
        if packed:
            out_layers[name] = pack_weight(
                [[int8_blocks(ql, sl)] for ql, sl in zip(q, scale, strict=True)]
            )
        else:
            out_layers[name], out_layers[name + SCALE] = q.reshape(w.shape), scale
    out = {**params, "layers": out_layers}
    head = "embed" if cfg.tie_word_embeddings else "lm_head"
    matrix = np.asarray(params[head])  # [D, V] as the head reads it
    matrix = matrix.T if head == "embed" else matrix
    q, scale = quantize_channels(matrix)
    if packed:
        out[head] = pack_weight([[int8_blocks(q, scale)]])
    else:
        out[head], out[head + SCALE] = (q.T if head == "embed" else q), scale
    return out
