"""--quantization int8: a float checkpoint's matmul weights as symmetric int8 with a float32
scale per output column per group of 16 inputs (k), quantized once at load by qwix (absmax: a
group's scale is its largest magnitude / 127.5, qwix's symmetric int8 bound; its quants
round(w / scale) in [-128, 127]: every weight within half a step). One scale per whole column
(per-channel) is coarser: on SmolLM2 it agreed with float32 on 93.9% of next tokens, short of
the 99% this aims at (docs/quantization.md); the groups cost the native kernel nothing (its
INT8 panels keep a scale per 16 k anyway) and XLA's dot an eighth of a byte a weight.

The weights it rounds have activation-aware scales folded in first (jserve.models.awq, which
jserve.engine.setup.quantized_to_int8 runs before `int8_params`): the same float model, whose
weights lose less to the rounding where the activations are large.

Which weights: the four projections of every layer (`wqkv`, `wo`, `w_gate_up`, `w_down`, fused
first, so a fused column keeps the scales of the column it was) and the output head (the
embedding, when tied: the lookup then reads the int8 table). Norms, biases and an untied
embedding (a lookup, not a matmul) stay float.

The same numbers (q, scale) take one of two layouts, by where the projections run
(jserve.pallas.layer_matmul):
- "native" (CPU, float32): packed as INT8 panels (jserve.pallas.quant_blocks: each group of 16
  k of a column with its float32 scale), uint8 arrays like a GGUF's packed blocks, multiplied
  by native/quant_matmul_cpu.cc, which makes each weight `scale * q` in float32 in registers;
- "xla" (TPU, GPU, a model split over devices): q as int8 arrays of the parameters' own shapes
  and the scales beside them (`NAME_scale` [L, K / 16, N]; the tied embedding's [V, D / 16],
  declared by `LlamaModel(..., int8_weights=True)`); qwix's dot_general scales and converts q
  inside the dot, which XLA fuses.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import qwix

from jserve.models.config import ModelConfig
from jserve.models.llama import PROJECTIONS, fuse_projections
from jserve.pallas.quant_blocks import (
    INT8_GROUP,
    BlockFormat,
    BlockMatrix,
    pack_weight,
    packed_bytes,
)

INT8 = "int8"  # what LoadedModel.quantization reports for these weights
SCALE = "_scale"  # NAME + SCALE: the scales of int8 parameter NAME ("xla" layout)
_UNFUSED = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
GROUP = INT8_GROUP  # inputs (k) sharing a scale: 16


def quantize_channels(w: Any) -> tuple[np.ndarray, np.ndarray]:
    """w [..., K, N] float -> (q int8 [..., K, N], scale float32 [..., K / 16, N]): symmetric,
    a scale per output column per GROUP inputs (and per leading index: a layer), by qwix:
    |w - q * scale| <= scale / 2."""
    w = jnp.asarray(w, jnp.float32)
    if w.shape[-2] % GROUP:
        raise ValueError(
            f"--quantization int8 needs every matmul's input size (K) to be a multiple of "
            f"{GROUP}; a weight has K={w.shape[-2]}"
        )
    q, scale = _quantize(w)
    return np.asarray(q), np.asarray(scale)


@jax.jit
def _quantize(w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """qwix's quantizer as one program per weight shape: run op by op, each of its ops is a
    program of its own, compiled for every shape (4x the time on SmolLM2, same bits)."""
    channels = (*range(w.ndim - 2), w.ndim - 1)
    quantized = qwix.quantize(
        w, jnp.int8, channelwise_axes=channels, tiled_axes={w.ndim - 2: GROUP}
    )
    return quantized.qvalue, quantized.scale


def dequantized(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """What every matmul multiplies by: q [..., K, N] * its scales [..., K / 16, N], float32."""
    return q.astype(np.float32) * np.repeat(scale.astype(np.float32), GROUP, axis=-2)


def int8_blocks(q: np.ndarray, scale: np.ndarray) -> BlockMatrix:
    """One weight's q [K, N] and scale [K / 16, N] as INT8 blocks: N rows of K / 16 blocks,
    each its float32 scale and 16 quants."""
    k, n = q.shape
    rows = np.empty((n, k // GROUP, 4 + GROUP), np.uint8)
    rows[..., :4] = np.ascontiguousarray(np.asarray(scale, "<f4").T)[..., None].view(np.uint8)
    rows[..., 4:] = np.ascontiguousarray(q.T).reshape(n, k // GROUP, GROUP).view(np.uint8)
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
    elif head == "embed":  # the table's own orientation: [V, D] and [V, D / 16]
        out[head], out[head + SCALE] = q.T, scale.T
    else:
        out[head], out[head + SCALE] = q, scale
    return out
