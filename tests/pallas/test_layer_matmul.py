"""`layer_matmul` (jserve.pallas.layer_matmul) against a float64 numpy product of the one layer.

The native kernel is held to the same reference as XLA's dot: odd shapes (columns not a
multiple of a vector, rows not a multiple of its 4-row blocks), every layer of the stack, and
NaN in every other layer, which must never reach the output.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.pallas.layer_matmul import NATIVE_MAX_TOKENS, choose_matmul_impl, layer_matmul


def _case(tokens: int, k: int, n: int, layers: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = rng.standard_normal((layers, k, n)).astype(np.float32)
    return x, w


def _expected(x: np.ndarray, w: np.ndarray, layer: int) -> np.ndarray:
    return x.astype(np.float64) @ w[layer].astype(np.float64)


@pytest.mark.parametrize("impl", ["xla", "native"])
@pytest.mark.parametrize("tokens", [1, 2, 3, 8])
@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 8), (13, 37), (7, 3)])
def test_matches_float64_product_of_the_layer(impl, tokens, k, n):
    x, w = _case(tokens, k, n)
    fn = jax.jit(lambda x, w, layer: layer_matmul(x, w, layer, impl))
    for layer in range(w.shape[0]):
        got = np.asarray(fn(jnp.asarray(x), jnp.asarray(w), jnp.int32(layer)))
        np.testing.assert_allclose(got, _expected(x, w, layer), rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("tokens", range(1, NATIVE_MAX_TOKENS + 1))
def test_native_reads_only_its_layer(tokens):
    x, w = _case(tokens, 40, 20, layers=4)
    poisoned = np.full_like(w, np.nan)
    poisoned[2] = w[2]
    got = jax.jit(lambda x, w: layer_matmul(x, w, jnp.int32(2), "native"))(x, poisoned)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), _expected(x, w, 2), rtol=1e-4, atol=1e-4)


def test_native_is_chosen_for_float32_on_cpu_only():
    assert choose_matmul_impl("cpu", jnp.float32) == "native"  # the tests run with a compiler
    assert choose_matmul_impl("cpu", jnp.bfloat16) == "xla"
    assert choose_matmul_impl("gpu", jnp.float32) == "xla"


def test_bad_arguments_say_what_to_fix():
    x, w = _case(1, 8, 4)
    with pytest.raises(ValueError, match="matmul impl must be one of"):
        layer_matmul(x, w, 0, "fast")
    with pytest.raises(ValueError, match=r"x \[T, K\] and w \[L, K, N\]"):
        layer_matmul(x, w[0], 0, "native")
    with pytest.raises(ValueError, match="needs float32"):
        layer_matmul(jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16), 0, "native")
