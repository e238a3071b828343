"""Calibration activations for --quantization int8's activation-aware scales (jserve.models.awq):
the mean |x| of each input channel of every projection's input, per layer, from the float
model run over a calibration text.

The text is the Apache License 2.0 (`calibration.txt`, shipped with the package: freely
redistributable, a few thousand tokens of prose), which none of bench/texts' scored texts is,
so the fidelity bench.quality measures is not the calibration set's own. The model runs dense
causal windows (no KV cache) through `LlamaModel(observe=...)`, which hands each projection's
per-channel sums of |x| to the host.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jserve.layers.attention import DenseCausal
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import int8_matrix_shapes
from jserve.models.llama import PROJECTIONS, LlamaModel, fuse_projections

CALIBRATION_TEXT = Path(__file__).with_name("calibration.txt")
WINDOW = 512  # tokens a dense causal pass reads at most


def input_widths(cfg: ModelConfig) -> dict[str, int]:
    """K, the input channels, of each projection (int8_weights' [L, K, N] shapes)."""
    shapes = int8_matrix_shapes(cfg)
    return {name: shapes[name][1] for name in PROJECTIONS}


def calibration_windows(ids: list[int], vocab_size: int) -> np.ndarray:
    """`ids` as [n, T] windows of equal length (one compiled shape), at most WINDOW tokens each;
    the few ids past the last whole window are left out, and so are ids the embedding has no
    row for (a test model that borrows a larger model's tokenizer)."""
    kept = np.asarray([i for i in ids if i < vocab_size], np.int32)
    if kept.size == 0:
        raise ValueError("the calibration text has no token in the model's vocabulary")
    n = -(-kept.size // WINDOW)
    length = kept.size // n
    return kept[: n * length].reshape(n, length)


def activation_means(
    cfg: ModelConfig, params: dict[str, Any], windows: np.ndarray
) -> dict[str, np.ndarray]:
    """{projection: mean |x| [L, K] float32}: over every position of `windows` ([n, T] token
    ids, each a causal sequence of its own), each input channel of each layer's projection, as
    the float32 model computes it from `params` (a loader's tree)."""
    layers = cfg.num_layers
    sums = {name: np.zeros((layers, k)) for name, k in input_widths(cfg).items()}

    def observe(name: str, layer: np.ndarray, total: np.ndarray) -> None:
        sums[name][int(layer)] += total

    graphdef, state = nnx.split(nnx.eval_shape(lambda: LlamaModel(cfg)))
    fused = {**params, "layers": fuse_projections(cfg, params["layers"])}
    nnx.replace_by_pure_dict(state, jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), fused))
    length = windows.shape[1]
    positions = jnp.arange(length, dtype=jnp.int32)

    @jax.jit
    def run(state: nnx.State, ids: jax.Array) -> jax.Array:
        model = nnx.merge(graphdef, state)
        last = jnp.array([length - 1], jnp.int32)  # the head's product is not needed
        return model(ids, positions, None, DenseCausal(), last, observe=observe)[0]

    for ids in windows:
        run(state, jnp.asarray(ids))
    jax.effects_barrier()  # every callback has run
    return {name: (total / windows.size).astype(np.float32) for name, total in sums.items()}
