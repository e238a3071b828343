"""--quantization int8's weights (jserve.models.int8_weights): qwix's quantizer (a scale per 16
inputs of each output column) within half a step of every weight, and both matmuls over them,
the native kernel's INT8 panels (every ISA level this machine runs) and XLA's dot through qwix,
against a float64 numpy product of the dequantized weight `q * scale`."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.models.int8_weights import dequantized, int8_blocks, quantize_channels
from jserve.pallas.layer_matmul import layer_matmul, packed_columns
from jserve.pallas.quant_blocks import BlockFormat, pack_weight, packed_bytes
from tests.pallas.native_levels import NATIVE


def _weights(layers: int, k: int, n: int, seed: int = 0) -> np.ndarray:
    """Columns of very different magnitudes (the case a per-channel scale exists for), an
    outlier, and one column all zeros."""
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((layers, k, n)) * np.logspace(-3, 1, n)
    w[:, 3, 1] = 40.0
    w[:, :, 2] = 0.0
    return w.astype(np.float32)


def test_quantization_is_within_half_a_step_of_every_weight_per_group_of_16():
    w = _weights(3, 64, 24)
    q, scale = quantize_channels(w)
    assert q.dtype == np.int8 and q.shape == w.shape
    assert scale.dtype == np.float32 and scale.shape == (3, 4, 24)  # K / 16 groups
    absmax = np.abs(w).reshape(3, 4, 16, 24).max(axis=2)
    nonzero = absmax > 0
    # qwix's symmetric int8 bound: a group's largest magnitude is 127.5 steps, the edge of the
    # last bucket, so the whole int8 range is used and it too is within half a step.
    np.testing.assert_allclose(scale[nonzero], absmax[nonzero] / 127.5, rtol=1e-6)
    steps = np.abs(q.astype(np.int32)).reshape(3, 4, 16, 24).max(axis=2)
    assert (steps[nonzero] >= 127).all()
    error = np.abs(w - dequantized(q, scale))
    assert (error <= np.repeat(scale, 16, axis=1) * (0.5 + 1e-5)).all()
    assert not q[:, :, 2].any() and not dequantized(q, scale)[:, :, 2].any()


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize(("tokens", "k", "n"), [(1, 48, 40), (3, 64, 16), (20, 96, 37)])
def test_native_int8_panels_match_float64_of_the_dequantized_weight(impl, tokens, k, n):
    w = _weights(2, k, n, seed=tokens)
    q, scale = quantize_channels(w)
    packed = pack_weight([[int8_blocks(ql, sl)] for ql, sl in zip(q, scale, strict=True)])
    assert packed.size == packed_bytes(BlockFormat.INT8, 2, k, n)
    x = np.random.default_rng(k).standard_normal((tokens, k)).astype(np.float32)
    floats = dequantized(q, scale).astype(np.float64)
    fn = jax.jit(lambda x, w, layer: layer_matmul(x, w, layer, "native", n))
    for layer in range(2):
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(packed), jnp.int32(layer)))
        expected = x.astype(np.float64) @ floats[layer]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
    # A tied embedding's lookup: column v of the head's packed weight is token v's row.
    head = pack_weight([[int8_blocks(q[0], scale[0])]])
    ids = jnp.asarray([0, 5, n - 1], jnp.int32)
    columns = np.asarray(packed_columns(jnp.asarray(head), ids, k))
    np.testing.assert_array_equal(columns, dequantized(q, scale)[0][:, [0, 5, n - 1]].T)


def test_xla_int8_dot_matches_float64_of_the_dequantized_weight():
    w = _weights(2, 48, 40)
    q, scale = quantize_channels(w)
    x = np.random.default_rng(1).standard_normal((5, 48)).astype(np.float32)
    fn = jax.jit(lambda x, w, s, layer: layer_matmul(x, w, layer, "xla", scale=s))
    floats = dequantized(q, scale).astype(np.float64)
    for layer in range(2):
        got = np.asarray(fn(x, jnp.asarray(q), jnp.asarray(scale), jnp.int32(layer)))
        expected = x.astype(np.float64) @ floats[layer]
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())


def test_a_k_the_groups_cannot_split_is_refused_naming_it():
    with pytest.raises(ValueError, match="multiple of 16; a weight has K=40"):
        quantize_channels(_weights(1, 40, 16))
