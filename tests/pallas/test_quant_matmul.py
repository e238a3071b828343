"""The packed GGUF-block matmul (native/quant_matmul_cpu.cc) against a float64 numpy product of
gguf's own dequantization, and against the float32 kernel on those dequantized weights, which
it must match bit for bit (so serving the blocks never changes a token): every format, at
every ISA level this machine runs (tests/pallas/native_levels.py), with ragged row counts, N
not a multiple of the 16-column panel, a step's padding rows, several layers, formats mixed
within a weight and across its layers; and the embedding lookup's column gather."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.pallas.layer_matmul import layer_matmul, pack_layer_weight, packed_columns
from jserve.pallas.quant_blocks import (
    PANEL,
    BlockFormat,
    BlockMatrix,
    pack_weight,
    take_columns,
    weight_info,
)
from tests.pallas.native_levels import NATIVE
from tests.pallas.quant_cases import dequantized, random_blocks

FORMATS = list(BlockFormat)


def _matmul(x: np.ndarray, w: np.ndarray, layer: int, n: int, rows: int | None = None):
    """x @ layer `layer` of w (packed blocks or float panels) by the native kernel, traced now
    (so at the ISA level set now)."""
    rows = x.shape[0] if rows is None else rows
    fn = jax.jit(lambda x, w, r: layer_matmul(x, w, jnp.int32(layer), "native", n, r))
    return np.asarray(fn(jnp.asarray(x), jnp.asarray(w), jnp.int32(rows)))


def _float_panels(layers: list[np.ndarray]) -> jax.Array:
    return pack_layer_weight(jnp.asarray(np.stack(layers)), "native")


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize("fmt", FORMATS)
# (tokens, K, N): one token, two tokens over blocks of four panels and the rest, a short
# register block, N under one panel, more rows than a register block (the first keeps the
# weights it makes, the float32 block reads them for the rest), and rows in two chunks of L2
# (a long K makes chunks short)
@pytest.mark.parametrize(
    ("tokens", "k", "n"),
    [(1, 256, 40), (2, 256, 100), (3, 512, 16), (17, 256, 7), (100, 1536, 40)],
)
def test_matches_float64_and_the_float32_kernel_bit_for_bit(impl, fmt, tokens, k, n):
    rng = np.random.default_rng(tokens * k + n)
    mats = [random_blocks(fmt, n, k, rng) for _ in range(2)]
    packed = pack_weight([[m] for m in mats])
    floats = [dequantized(m) for m in mats]
    x = rng.standard_normal((tokens, k)).astype(np.float32)
    for layer in range(2):
        got = _matmul(x, packed, layer, n)
        expected = x.astype(np.float64) @ floats[layer].astype(np.float64)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5 * np.abs(expected).max())
        np.testing.assert_array_equal(got, _matmul(x, _float_panels(floats), layer, n))


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize(("tokens", "rows"), [(40, 33), (8, 0), (9, 9)])
def test_computes_the_real_rows_and_zeros_the_padding(impl, tokens, rows):
    """Padding rows hold NaN, which no computed row may read; they come out as zeros."""
    rng = np.random.default_rng(rows)
    m = random_blocks(BlockFormat.Q4_1, 3 * PANEL + 5, 256, rng)
    x = rng.standard_normal((tokens, 256)).astype(np.float32)
    x[rows:] = np.nan
    got = _matmul(x, pack_weight([[m]]), 0, m.n, rows)
    expected = x[:rows].astype(np.float64) @ dequantized(m).astype(np.float64)
    np.testing.assert_allclose(got[:rows], expected, rtol=1e-5, atol=1e-4)
    assert not got[rows:].any()


@pytest.mark.parametrize("impl", NATIVE)
def test_formats_mixed_within_a_weight_and_across_layers(impl):
    """A Q4_K_M-like weight: layer 0 Q4_K, Q6_K and Q8_0 columns side by side, runs of odd
    panel counts (a register block of two panels must never pair two formats), layer 1 all
    Q6_K."""
    rng = np.random.default_rng(7)
    k = 256
    runs = [("Q4_K", PANEL), ("Q6_K", 2 * PANEL), ("Q8_0", PANEL), ("Q4_K", PANEL + 3)]
    layer0 = [random_blocks(BlockFormat(f), n, k, rng) for f, n in runs]
    n = sum(m.n for m in layer0)
    layer1 = [random_blocks(BlockFormat.Q6_K, n, k, rng)]
    packed = pack_weight([layer0, layer1])
    floats = [np.concatenate([dequantized(m) for m in layer0], axis=1), dequantized(layer1[0])]
    for tokens in (1, 5):  # blocks of four panels at one token, of two at more
        x = rng.standard_normal((tokens, k)).astype(np.float32)
        for layer in range(2):
            np.testing.assert_array_equal(
                _matmul(x, packed, layer, n), _matmul(x, _float_panels(floats), layer, n)
            )
    counts = {"Q4_K": 3, "Q6_K": 2 + 6, "Q8_0": 1}
    assert weight_info(packed) == {"layers": 2, "panels": 6, "k": k, **counts}


@pytest.mark.parametrize("impl", NATIVE)
@pytest.mark.parametrize("fmt", FORMATS)
def test_columns_are_the_dequantized_columns(impl, fmt):
    """The embedding lookup of a tied table: column v of the head's packed weight, ids past N
    clamped to the last panel's (zero) padding."""
    rng = np.random.default_rng(3)
    m = random_blocks(fmt, 2 * PANEL + 5, 256, rng)
    ids = np.array([0, 36, 5, 20, 36, 1], np.int32)
    got = np.asarray(jax.jit(packed_columns, static_argnums=2)(pack_weight([[m]]), ids, m.k))
    np.testing.assert_array_equal(got, dequantized(m).T[ids])
    past = np.asarray(packed_columns(jnp.asarray(pack_weight([[m]])), jnp.int32([999]), m.k))
    assert not past.any()


def test_take_columns_orders_columns_across_sources():
    """Interleaving two sources' columns, as the fused gate/up weight does, keeps every block
    and yields one run per change of format."""
    rng = np.random.default_rng(1)
    a = random_blocks(BlockFormat.Q4_0, 4, 32, rng)
    b = random_blocks(BlockFormat.Q4_0, 4, 32, rng)
    [run] = take_columns([a, b], np.array([0, 4, 1, 5, 2, 6, 3, 7]))
    np.testing.assert_array_equal(run.rows[0::2], a.rows)
    np.testing.assert_array_equal(run.rows[1::2], b.rows)
    c = random_blocks(BlockFormat.Q8_0, 2, 32, rng)
    runs = take_columns([a, c], np.array([0, 1, 4, 5, 2]))
    assert [(r.format, r.n) for r in runs] == [("Q4_0", 2), ("Q8_0", 2), ("Q4_0", 1)]
    np.testing.assert_array_equal(runs[1].rows, c.rows)


def test_bad_weights_say_what_to_fix():
    rng = np.random.default_rng(2)
    q4 = random_blocks(BlockFormat.Q4_0, 5, 32, rng)
    with pytest.raises(ValueError, match="ends inside a panel"):
        pack_weight([[q4, random_blocks(BlockFormat.Q8_0, 16, 32, rng)]])
    with pytest.raises(ValueError, match="layer 1 is not"):
        pack_weight([[q4], [random_blocks(BlockFormat.Q4_0, 6, 32, rng)]])
    with pytest.raises(ValueError, match="must be"):
        BlockMatrix(BlockFormat.Q4_K, np.zeros((4, 144), np.uint8), 32)
    x = jnp.ones((2, 32), jnp.float32)
    with pytest.raises(ValueError, match="native' only"):
        layer_matmul(x, jnp.asarray(pack_weight([[q4]])), 0, "xla", 5)


def test_the_kernel_refuses_a_weight_that_does_not_fit(native_kernels):
    """K or N other than the packed weight's, a wrong layer, or bytes that are no packed
    weight are errors the kernel names, never a read out of bounds."""
    q4 = pack_weight([[random_blocks(BlockFormat.Q4_0, 5, 64, np.random.default_rng(4))]])
    x = np.ones((2, 64), np.float32)
    with pytest.raises(Exception, match="do not match"):
        _matmul(np.ones((2, 32), np.float32), q4, 0, 5)
    with pytest.raises(Exception, match="do not match"):
        _matmul(x, q4, 0, 17)
    with pytest.raises(Exception, match="layer out of range"):
        _matmul(x, q4, 1, 5)
    with pytest.raises(Exception, match="not a packed weight"):
        _matmul(x, np.zeros(4096, np.uint8), 0, 5)
    broken = q4.copy()
    broken[32:40] = np.frombuffer(np.int64(1 << 40 | 1).tobytes(), np.uint8)  # offset past it
    with pytest.raises(Exception, match="offset is wrong"):
        _matmul(x, broken, 0, 5)
