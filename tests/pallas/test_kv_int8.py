"""int8 KV pools (--kv-cache-dtype int8): the per-token quantization's error bound, its write
beside the pool, and every implementation that reads int8 pools against float64 numpy attention
over the dequantized K/V (the native kernel at each ISA level this machine runs).

Slots an implementation must not read hold int8 garbage and a NaN scale, so any read of them
reaches the output as NaN.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from jserve.pallas import choose_impl, ragged_paged_attention, write_kv_cache
from jserve.pallas.kv_cache import dequantize_kv, kv_scales_shape, quantize_kv, rotate_heads
from tests.pallas.native_levels import NATIVE
from tests.pallas.ragged_cases import (
    QUANTIZED_POOL_CASES,
    Geometry,
    build_case,
    naive_attention,
    padding_rows,
    quantized_case,
    relative_error,
)

QUANTIZED_IMPLS = ["reference", "xla", *NATIVE, "triton"]  # Triton interpreted here
# The native kernel's vectors do not divide head_dim 72: its tail path reads int8 pools too.
CASES = {
    **QUANTIZED_POOL_CASES,
    "d72_off_the_vectors": ([(1, 40), (9, 9)], Geometry(head_dim=72), {}),
}


def test_round_trip_error_is_at_most_half_a_step_per_element():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 3, 64)).astype(np.float32) * rng.uniform(1e-3, 1e3, (64, 3, 1))
    x[5, 1] = 0.0  # an all-zero row: scale 0, exact zeros
    q, scale = (np.asarray(a) for a in quantize_kv(jnp.asarray(x)))
    assert q.dtype == np.int8 and scale.dtype == np.float32 and scale.shape == (64, 3)
    np.testing.assert_allclose(scale, np.abs(x).max(axis=-1) / 127, rtol=1e-6)
    back = np.asarray(dequantize_kv(jnp.asarray(q), jnp.asarray(scale)))
    bound = scale[..., None] * (0.5 + 1e-5)  # rounding to nearest, plus float32's own rounding
    assert np.all(np.abs(back - x) <= bound)
    assert np.all(np.abs(q).max(axis=-1)[scale > 0] == 127)  # the absmax lands on +-127
    assert scale[5, 1] == 0 and np.all(back[5, 1] == 0)
    # Relative to the row's largest value, the error is at most 1/254.
    assert np.max(np.abs(back - x) / np.abs(x).max(axis=-1, keepdims=True).clip(1e-30)) <= 1 / 254


@pytest.mark.parametrize("dtype", [np.int8, jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_the_write_quantizes_into_its_slots_and_scales_beside_them(dtype):
    layers, blocks, bs, heads, d = 3, 6, 4, 2, 8
    pool = np.full((layers, blocks, heads, bs, d), 5, dtype)
    scales = np.full(kv_scales_shape(layers, blocks, bs, heads), 0.25, np.float32)
    rng = np.random.default_rng(1)
    k = rng.standard_normal((3, heads, d)).astype(np.float32)
    slots = np.array([4, 7, 17], np.int32)
    cache = tuple(map(jnp.asarray, (pool, -pool, scales, 2 * scales)))
    new = [np.asarray(a) for a in write_kv_cache(cache, k, -k, slots, jnp.int32(2), impl="xla")]
    assert new[0].dtype == dtype and new[2].dtype == np.float32
    want_q, want_s = (np.asarray(a) for a in quantize_kv(jnp.asarray(k), jnp.dtype(dtype)))
    for t, slot in enumerate(slots):
        block, off = divmod(int(slot), bs)
        np.testing.assert_array_equal(new[0][2, block, :, off], want_q[t])
        np.testing.assert_array_equal(new[1][2, block, :, off], -want_q[t])
        np.testing.assert_array_equal(new[2][2, block, :, off], want_s[t])
        np.testing.assert_array_equal(new[3][2, block, :, off], want_s[t])
    written = np.zeros((layers, blocks, bs), bool)
    written[2, slots // bs, slots % bs] = True
    untouched = ~written[:, :, None, :]  # [L, blocks, 1, bs] against the [L, blocks, H, bs]
    untouched = np.broadcast_to(untouched, scales.shape)
    assert np.all(new[0][untouched] == 5) and np.all(new[1][untouched] == -5)
    assert np.all(new[2][untouched] == 0.25) and np.all(new[3][untouched] == 0.5)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", QUANTIZED_IMPLS)
def test_int8_pools_match_float64_attention_over_the_dequantized_values(impl, name):
    seqs, geometry, options = CASES[name]
    if impl == "triton" and geometry.head_dim & (geometry.head_dim - 1):
        pytest.skip("the Triton kernel's tiles need a power-of-two head_dim")
    case = build_case(seqs, geometry, seed=len(name))
    (k8, v8, ks, vs), dequant = quantized_case(case)
    sm_scale = geometry.head_dim**-0.5
    out = ragged_paged_attention(
        *map(jnp.asarray, (case.q, k8, v8, case.block_tables, case.cu_q_lens, case.kv_lens)),
        jnp.asarray(case.num_seqs), jnp.asarray(case.layer),
        sm_scale=sm_scale, impl=impl, kv_scales=(jnp.asarray(ks), jnp.asarray(vs)), **options,
    )  # fmt: skip
    out = np.asarray(out)
    ref = naive_attention(dequant, sm_scale, options.get("sliding_window"), options.get("soft_cap"))
    assert out.dtype == np.float32 and not np.isnan(out).any(), f"{impl}: NaN in the output"
    assert relative_error(case, out, ref) <= 1e-5
    assert np.all(padding_rows(case, out) == 0)


def test_int8_attention_is_close_to_the_float_pools():
    """What the quantization costs an attention output: a few thousandths of its scale."""
    case = build_case(*CASES["decode_and_prefill"][:2], seed=3)
    (k8, v8, ks, vs), _ = quantized_case(case)
    sm_scale = 64**-0.5
    ref = naive_attention(case, sm_scale, None, None)
    out = ragged_paged_attention(
        *map(jnp.asarray, (case.q, k8, v8, case.block_tables, case.cu_q_lens, case.kv_lens)),
        jnp.asarray(case.num_seqs), jnp.asarray(case.layer),
        sm_scale=sm_scale, impl="xla", kv_scales=(jnp.asarray(ks), jnp.asarray(vs)),
    )  # fmt: skip
    assert relative_error(case, np.asarray(out), ref) < 2e-2


def test_int8_pools_go_to_the_implementations_that_read_them():
    assert choose_impl("tpu", jnp.bfloat16, "int8") == "xla"
    assert choose_impl("gpu", jnp.bfloat16, "int8") == "triton"
    assert choose_impl("tpu", jnp.bfloat16) == "mosaic"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            dict(impl="interpret"),
            r"int8 KV pools are read by impl \['reference', 'xla', 'native', 'triton'\]",
        ),
        (dict(kv_scales=None), r"or the pools be int8 with kv_scales"),
        (dict(scales_shape=(2, 9, 3, 8)), r"two float32 kv_scales \[2, 9, 3, 16\]"),
        (dict(scales_dtype=jnp.float16), r"two float32 kv_scales"),
        (dict(q_dtype=jnp.int8), r"q one of \['float32', 'bfloat16', 'float16'\]"),
    ],
)
def test_int8_pools_are_refused_without_what_reads_them(change, message):
    shape = (2, 9, 3, 16, 64)
    pool = jnp.zeros(shape, jnp.int8)
    scales_shape = change.get("scales_shape", shape[:4])
    scale = jnp.zeros(scales_shape, change.get("scales_dtype", jnp.float32))
    q = jnp.zeros((4, 9, 64), change.get("q_dtype", jnp.float32))
    i32 = jnp.zeros
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(
            q, pool, pool, i32((2, 3), jnp.int32), i32(3, jnp.int32), i32(2, jnp.int32),
            i32(1, jnp.int32), jnp.int32(0), sm_scale=0.125, impl=change.get("impl", "xla"),
            kv_scales=change.get("kv_scales", (scale, scale)),
        )  # fmt: skip


def test_the_rotation_keeps_dot_products_and_shrinks_an_outlier_channels_error():
    """rotate_heads (what an int8 pool stores, kv_cache) is its own inverse and keeps q . k;
    with one channel 30x the others, rotating before the per-token scale is taken cuts the
    quantization error of the rest several times over."""
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((2, 256, 3, 64)).astype(np.float32)
    k[..., 5] *= 30.0  # an outlier channel, as real K heads have
    rq, rk = (np.asarray(rotate_heads(jnp.asarray(x))) for x in (q, k))
    np.testing.assert_allclose(np.asarray(rotate_heads(jnp.asarray(rk))), k, atol=1e-4)
    np.testing.assert_allclose((rq * rk).sum(-1), (q * k).sum(-1), rtol=1e-4, atol=1e-3)

    def error(x: np.ndarray, rotate: bool) -> float:
        x = jnp.asarray(x)
        back = dequantize_kv(*quantize_kv(rotate_heads(x) if rotate else x))
        back = rotate_heads(back) if rotate else back
        return float(np.abs(np.asarray(back) - np.asarray(x))[..., np.arange(64) != 5].mean())

    assert error(k, rotate=True) < error(k, rotate=False) / 4
    odd = jnp.ones((2, 72))  # not a power of two: left as it is
    assert rotate_heads(odd) is odd
