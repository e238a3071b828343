"""RMSNorm as HF Llama computes it: statistics in float32, the weight applied in the input dtype."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., D], weight: [D] -> [..., D] in x's dtype."""
    x32 = x.astype(jnp.float32)
    variance = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    return weight * (x32 * jax.lax.rsqrt(variance + eps)).astype(x.dtype)
