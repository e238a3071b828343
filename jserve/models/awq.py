"""--quantization int8's activation-aware scales (AWQ, https://arxiv.org/abs/2306.00978),
folded into the float weights before they are rounded, so serving runs the same int8 kernels.

A projection y = x W rounds each group of W's weights to a grid set by its largest one, so the
rows k that meet large inputs x_k matter most. AWQ multiplies row k by s_k before rounding and
divides input k by s_k, which leaves the product unchanged in exact arithmetic and moves
rounding error off the salient rows. The search for s is qwix's
(`qwix.contrib.awq_core.search_optimal_scales`: s = mean|x|^r over a grid of r, the r whose
rounded weights give the least activation-weighted error), per layer and projection, from the
calibration means (jserve.models.calibration).

Nothing divides the inputs at run time: 1 / s goes into the weight that makes the input, an
exact change of the float model (up to float32 rounding) —
- `wqkv`, `w_gate_up` read the RMSNorms' outputs: the norm's gamma (`attn_norm`, `mlp_norm`)
  is divided by s;
- `wo` reads attention's output, whose channel (query head h, d) is a mix of value channel
  (KV head h // G, d): v's columns (and bias) are divided by s, so s is one per KV-head channel
  (the means averaged over the G query heads that share it);
- `w_down` reads silu(gate) * up: the `up` columns are divided by s.
Scaling a column by a constant scales its groups' int8 scales and leaves its quants as they
were, so v and up are folded first and `wqkv`, `w_gate_up` searched after. The output head
stays round-to-nearest: its input, the final norm, also feeds nothing else, but the tied
embedding's lookup would then need a table of its own.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from qwix._src.core.qarray import HowToQuantize
from qwix.contrib import awq_core

from jserve.models.calibration import activation_means
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import GROUP

# As int8_weights.quantize_channels rounds: a scale per output column per GROUP inputs, on
# qwix's [out, in] orientation.
_HOW = HowToQuantize(qtype=jnp.int8, channelwise_axes=[0], tiled_axes={1: GROUP})


@jax.jit
def _search(w: jax.Array, means: jax.Array) -> jax.Array:
    return awq_core.search_optimal_scales(w, means, _HOW)[0]


def input_scales(w: np.ndarray, means: np.ndarray) -> np.ndarray:
    """w [L, K, N] and its inputs' mean |x| [L, K] -> each layer's AWQ scales s [L, K]."""
    layers = zip(w, means, strict=True)
    return np.stack([np.asarray(_search(jnp.asarray(wl.T), jnp.asarray(m))) for wl, m in layers])


def awq_params(cfg: ModelConfig, params: dict[str, Any], windows: np.ndarray) -> dict[str, Any]:
    """A loader's float tree with AWQ's scales folded in (module docstring), calibrated on
    `windows` (jserve.models.calibration.calibration_windows): the same model in float
    arithmetic, whose weights round to int8 with less error on real activations."""
    return folded(cfg, params, activation_means(cfg, params, windows))


def folded(cfg: ModelConfig, params: dict[str, Any], means: dict[str, np.ndarray]) -> dict:
    """`params` (a loader's tree) with the scales `input_scales` finds for `means` (the
    calibration means of each projection's input, jserve.models.calibration) folded in."""
    layers = {name: np.asarray(w, np.float32) for name, w in params["layers"].items()}
    _fold_into_values(cfg, layers, means["wo"])
    s = input_scales(layers["w_down"], means["w_down"])  # [L, F]
    layers["w_down"] = layers["w_down"] * s[..., None]
    layers["w_up"] = layers["w_up"] / s[:, None]
    _fold_into_norm(layers, ("wq", "wk", "wv"), "attn_norm", means["wqkv"])
    _fold_into_norm(layers, ("w_gate", "w_up"), "mlp_norm", means["w_gate_up"])
    return {**params, "layers": layers}


def _fold_into_values(cfg: ModelConfig, layers: dict[str, np.ndarray], means: np.ndarray) -> None:
    """`wo`'s rows times s, v's columns and bias divided by s: one s per KV-head channel."""
    L, Hq, Hkv, Hd = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    G = Hq // Hkv  # query head h reads KV head h // G
    shared = means.reshape(L, Hkv, G, Hd).mean(2, keepdims=True)
    shared = np.broadcast_to(shared, (L, Hkv, G, Hd)).reshape(L, Hq * Hd)
    wo = layers["wo"]  # [L, Hq, Hd, D]
    s = input_scales(wo.reshape(L, Hq * Hd, -1), shared).reshape(L, Hkv, G, Hd)[:, :, 0]
    layers["wo"] = wo * np.repeat(s, G, axis=1)[..., None]  # each query head its KV head's
    layers["wv"] = layers["wv"] / s[:, None]  # [L, D, Hkv, Hd]
    if "bv" in layers:
        layers["bv"] = layers["bv"] / s


def _fold_into_norm(
    layers: dict[str, np.ndarray], names: tuple[str, ...], norm: str, means: np.ndarray
) -> None:
    """The weights `names` (reading `norm`'s output: [L, D, ...]) times s along D, searched on
    them side by side, and the norm's gamma divided by s."""
    L, D = layers[norm].shape
    s = input_scales(np.concatenate([layers[n].reshape(L, D, -1) for n in names], -1), means)
    for n in names:
        w = layers[n]
        layers[n] = w * s.reshape(L, D, *[1] * (w.ndim - 2))
    layers[norm] = layers[norm] / s
