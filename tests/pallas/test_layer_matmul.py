"""`layer_matmul` (jserve.pallas.layer_matmul) against a float64 numpy product of the one layer.

The native kernel, on the weight as `pack_layer_weight` lays it out, is held to the same
reference as XLA's dot: odd shapes (columns not a multiple of the 16-column panel, rows not a
multiple of the register block, a register block of two panels whose second is padded, K of
one), every step size from one token to past a row chunk, every layer of the stack, and NaN
in every other layer, which must never reach the output; and a step's padding rows, which it
skips. The native kernel runs at every ISA level this machine can run
(tests/pallas/native_levels.py), and its AVX2 and AVX-512 blocks must agree bit for bit.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.pallas.layer_matmul import (
    PANEL,
    choose_matmul_impl,
    layer_matmul,
    pack_layer_weight,
)
from tests.pallas.native_levels import NATIVE, use_native_level


def _case(tokens: int, k: int, n: int, layers: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    w = rng.standard_normal((layers, k, n)).astype(np.float32)
    return x, w


def _expected(x: np.ndarray, w: np.ndarray, layer: int) -> np.ndarray:
    return x.astype(np.float64) @ w[layer].astype(np.float64)


def _run(impl: str, x: np.ndarray, w: np.ndarray, layers: list[int]) -> list[np.ndarray]:
    """x @ w[layer] by `impl` for each of `layers`, through one jitted function (traced here,
    so it calls the kernel of the ISA level set now)."""
    packed = pack_layer_weight(jnp.asarray(w), impl)
    fn = jax.jit(lambda x, p, layer: layer_matmul(x, p, layer, impl, n=w.shape[2]))
    return [np.asarray(fn(jnp.asarray(x), packed, jnp.int32(layer))) for layer in layers]


@pytest.mark.parametrize("impl", ["xla", *NATIVE])
@pytest.mark.parametrize("tokens", [1, 2, 3, 7, 8, 9, 17, 40])
# (24, 30): two panels, the second padded, which a two-panel register block takes together.
@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 8), (13, 37), (24, 30), (7, 3), (1, 16)])
def test_matches_float64_product_of_the_layer(impl, tokens, k, n):
    x, w = _case(tokens, k, n)
    for layer, got in enumerate(_run(impl, x, w, list(range(w.shape[0])))):
        np.testing.assert_allclose(got, _expected(x, w, layer), rtol=1e-4, atol=1e-4 * np.sqrt(k))


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
def test_native_past_a_row_chunk_and_panel_groups(impl, tokens):
    """Long K makes row chunks short (a chunk's rows of x fit in L2), so 300 tokens span
    several chunks; N of 40 panels plus a partial one spreads over several work units."""
    x, w = _case(tokens, 1536, 40 * PANEL + 5, layers=2)
    [got] = _run(impl, x, w, [1])
    np.testing.assert_allclose(got, _expected(x, w, 1), rtol=1e-4, atol=1e-3)


def test_native_levels_agree_bit_for_bit(monkeypatch):
    """The AVX-512 block computes each column as the AVX2 block does (one FMA per k, in k
    order), so the level a machine runs never changes a projection's bits."""
    x, w = _case(300, 1536, 40 * PANEL + 5, layers=2)
    outs = {}
    for isa in ("avx2", "avx512"):
        use_native_level(monkeypatch, isa)
        outs[isa] = _run("native", x, w, [0, 1])
    np.testing.assert_array_equal(outs["avx2"], outs["avx512"])


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize(("tokens", "rows"), [(64, 57), (300, 131), (8, 0), (9, 9)])
def test_native_computes_the_real_rows_and_zeros_the_padding(impl, tokens, rows):
    """`rows` real tokens of a padded bucket: the padding rows of x hold NaN here, which no
    computed row may read; they come out as zeros, the real ones as the product."""
    x, w = _case(tokens, 1536, 40 * PANEL + 5, layers=2)
    x[rows:] = np.nan
    packed = pack_layer_weight(jnp.asarray(w), impl)
    fn = jax.jit(lambda x, p, r: layer_matmul(x, p, jnp.int32(1), impl, w.shape[2], r))
    got = np.asarray(fn(jnp.asarray(x), packed, jnp.int32(rows)))
    np.testing.assert_allclose(got[:rows], _expected(x[:rows], w, 1), rtol=1e-4, atol=1e-3)
    assert not got[rows:].any()


@pytest.mark.parametrize("impl", NATIVE)
def test_native_reads_only_its_layer_and_columns(impl):
    x, w = _case(11, 40, 20, layers=4)
    poisoned = np.full_like(w, np.nan)
    poisoned[2] = w[2]
    packed = np.array(pack_layer_weight(jnp.asarray(poisoned), "native"))
    packed[:, -1, :, 20 % PANEL :] = np.nan  # the last panel's padding columns
    got = jax.jit(lambda x, w: layer_matmul(x, w, jnp.int32(2), impl, n=20))(x, packed)
    assert np.isfinite(np.asarray(got)).all()
    np.testing.assert_allclose(np.asarray(got), _expected(x, w, 2), rtol=1e-4, atol=1e-4)


def test_packed_layout_is_column_panels():
    w = np.arange(2 * 3 * 20, dtype=np.float32).reshape(2, 3, 20)
    packed = np.asarray(pack_layer_weight(jnp.asarray(w), "native"))
    assert packed.shape == (2, 2, 3, PANEL)
    np.testing.assert_array_equal(packed[1, 0], w[1, :, :PANEL])
    np.testing.assert_array_equal(packed[1, 1, :, :4], w[1, :, PANEL:])
    assert not packed[:, 1, :, 4:].any()
    assert pack_layer_weight(jnp.asarray(w), "xla").shape == w.shape


def test_native_is_chosen_for_float32_on_cpu_only(native_kernels):
    assert choose_matmul_impl("cpu", jnp.float32) == "native"
    assert choose_matmul_impl("cpu", jnp.bfloat16) == "xla"
    assert choose_matmul_impl("gpu", jnp.float32) == "xla"


def test_bad_arguments_say_what_to_fix():
    x, w = _case(1, 8, 20)
    packed = pack_layer_weight(jnp.asarray(w), "native")
    with pytest.raises(ValueError, match="matmul impl must be one of"):
        layer_matmul(x, w, 0, "fast")
    with pytest.raises(ValueError, match=r"x \[T, K\] and w \[L, K, N\]"):
        layer_matmul(x, w[0], 0, "xla")
    with pytest.raises(ValueError, match="packed by pack_layer_weight"):
        layer_matmul(x, w, 0, "native", n=20)  # not packed
    with pytest.raises(ValueError, match="needs n"):
        layer_matmul(x, packed, 0, "native", n=40)
    with pytest.raises(ValueError, match="needs float32"):
        bf16 = jnp.asarray(packed, jnp.bfloat16)
        layer_matmul(jnp.asarray(x, jnp.bfloat16), bf16, 0, "native", n=20)
    with pytest.raises(ValueError, match=r"needs w \[L, K, N\]"):
        pack_layer_weight(jnp.asarray(w[0]), "native")
