"""The pool layout and the KV write: exact, only the named slots of one layer, in place."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jserve.pallas import kv_cache_shape, write_kv
from jserve.pallas.kv_cache import validate_slot_mapping

L, NB, BS, HKV, D = 3, 6, 4, 2, 8
IMPL = "xla"  # the canonical layout and write (test_write_into_a_packed_pool...: Mosaic's)


def _pools(seed: int = 0):
    rng = np.random.default_rng(seed)
    shape = kv_cache_shape(L, NB, BS, HKV, D, impl=IMPL)
    return rng.standard_normal(shape, np.float32), rng.standard_normal(shape, np.float32)


def _expected(pool: np.ndarray, new: np.ndarray, slots: np.ndarray, layer: int) -> np.ndarray:
    out = pool.copy()
    for t, slot in enumerate(slots):
        out[layer, slot // BS, :, slot % BS] = new[t]
    return out


def test_layout_is_layer_block_head_token_dim():
    for impl in ("reference", "interpret", "xla", "native", "triton"):
        assert kv_cache_shape(30, 1000, 16, 3, 64, impl=impl) == (30, 1000, 3, 16, 64)


def test_mosaic_packs_short_heads_into_128_lane_rows():
    """TPU rows are 128 lanes: head_dim 64 packs 2 tokens a row, 32 packs 4 (when a block still
    fills whole 8-row tiles); head_dim 128 and 256 keep the canonical layout."""
    assert kv_cache_shape(30, 1000, 16, 3, 64, impl="mosaic") == (30, 1000, 3, 8, 128)
    assert kv_cache_shape(2, 8, 32, 1, 32, impl="mosaic") == (2, 8, 1, 8, 128)
    assert kv_cache_shape(2, 8, 16, 1, 32, impl="mosaic") == (2, 8, 1, 16, 32)
    assert kv_cache_shape(2, 8, 16, 8, 128, impl="mosaic") == (2, 8, 8, 16, 128)
    assert kv_cache_shape(2, 8, 16, 8, 256, impl="mosaic") == (2, 8, 8, 16, 256)
    with pytest.raises(ValueError, match="resolve 'auto' first"):
        kv_cache_shape(2, 8, 16, 8, 64, impl="auto")


def test_write_into_a_packed_pool_is_the_canonical_write_reshaped():
    """write_kv works on every layout: into a pool of 2 tokens a row it changes exactly the
    bytes the canonical write changes."""
    k_pool, v_pool = _pools()
    packed = (L, NB, HKV, BS // 2, 2 * D)
    rng = np.random.default_rng(3)
    k = rng.standard_normal((4, HKV, D), np.float32)
    slots = np.array([4, 5, 7, 17], np.int32)
    new_k, new_v = write_kv(
        *map(jnp.asarray, (k_pool.reshape(packed), v_pool.reshape(packed), k, -k, slots)),
        jnp.int32(1),
        impl="mosaic",
    )
    want_k, want_v = _expected(k_pool, k, slots, 1), _expected(v_pool, -k, slots, 1)
    np.testing.assert_array_equal(np.asarray(new_k), want_k.reshape(packed))
    np.testing.assert_array_equal(np.asarray(new_v), want_v.reshape(packed))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((2, 1, 16, 3, 64), "num_blocks must be >= 2"),
        ((0, 8, 16, 3, 64), "'num_layers': 0"),
        ((2, 8, 16, 3, 6.5), "'head_dim': 6.5"),
    ],
)
def test_kv_cache_shape_rejects_bad_sizes(args, message):
    with pytest.raises(ValueError, match=message):
        kv_cache_shape(*args, impl="xla")


def test_write_is_exact_and_touches_only_its_slots():
    k_pool, v_pool = _pools()
    rng = np.random.default_rng(1)
    k = rng.standard_normal((5, HKV, D), np.float32)
    v = rng.standard_normal((5, HKV, D), np.float32)
    slots = np.array([4, 5, 7, 17, 23], np.int32)  # block 1 twice, block 4, last slot
    new_k, new_v = write_kv(
        *map(jnp.asarray, (k_pool, v_pool, k, v, slots)), jnp.int32(2), impl=IMPL
    )
    np.testing.assert_array_equal(np.asarray(new_k), _expected(k_pool, k, slots, 2))
    np.testing.assert_array_equal(np.asarray(new_v), _expected(v_pool, v, slots, 2))


def test_pad_tokens_only_change_the_sink_block():
    k_pool, v_pool = _pools()
    k = np.full((3, HKV, D), 7.0, np.float32)
    slots = np.array([9, 0, 0], np.int32)  # one real token, two pad tokens in the sink
    new_k, _ = write_kv(*map(jnp.asarray, (k_pool, v_pool, k, k, slots)), jnp.int32(0), impl=IMPL)
    new_k = np.asarray(new_k)
    np.testing.assert_array_equal(new_k[0, 0, :, 0], k[1])
    changed = np.argwhere(np.any(new_k != k_pool, axis=(2, 4)))  # (layer, block, offset)
    assert {tuple(x) for x in changed} == {(0, 0, 0), (0, 2, 1)}


def test_donated_write_is_in_place():
    k_pool, v_pool = map(jnp.asarray, _pools())
    before = (k_pool.unsafe_buffer_pointer(), v_pool.unsafe_buffer_pointer())
    k = jnp.ones((2, HKV, D), jnp.float32)
    step = jax.jit(functools.partial(write_kv, impl=IMPL), donate_argnums=(0, 1))
    new_k, new_v = step(k_pool, v_pool, k, k, jnp.array([3, 8], jnp.int32), jnp.int32(1))
    assert (new_k.unsafe_buffer_pointer(), new_v.unsafe_buffer_pointer()) == before


def test_write_inside_layer_scan_with_traced_layer():
    """The engine's pattern: lax.scan over layers carrying the whole pool, layer traced."""
    k_pool, v_pool = _pools()
    rng = np.random.default_rng(2)
    ks = rng.standard_normal((L, 2, HKV, D), np.float32)
    slots = np.array([6, 13], np.int32)

    @jax.jit
    def all_layers(k_pool, v_pool, ks):
        def body(pools, xs):
            layer, k = xs
            return write_kv(*pools, k, -k, jnp.asarray(slots), layer, impl=IMPL), None

        layers = jnp.arange(L, dtype=jnp.int32)
        return jax.lax.scan(body, (k_pool, v_pool), (layers, ks))[0]

    new_k, new_v = all_layers(*map(jnp.asarray, (k_pool, v_pool, ks)))
    want_k, want_v = k_pool, v_pool
    for layer in range(L):
        want_k = _expected(want_k, ks[layer], slots, layer)
        want_v = _expected(want_v, -ks[layer], slots, layer)
    np.testing.assert_array_equal(np.asarray(new_k), want_k)
    np.testing.assert_array_equal(np.asarray(new_v), want_v)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(k=np.zeros((2, HKV + 1, D), np.float32)), r"k and v must be \[T, num_kv_heads=2"),
        (dict(k=np.zeros((2, HKV, 3), np.float32)), "head_dim dividing the pool's rows of 8"),
        (dict(slots=np.zeros(3, np.int32)), r"slot_mapping must be int32 \[T=2\]"),
        (dict(slots=np.zeros(2, np.float32)), "slot_mapping must be int32"),
        (dict(k=np.zeros((2, HKV, D), np.float16)), "must match the pools"),
        (dict(v_pool=np.zeros((L, NB, HKV, BS, D + 1), np.float32)), "k_pool and v_pool"),
    ],
)
def test_write_kv_static_validation(change, message):
    k_pool, v_pool = _pools()
    args = dict(k_pool=k_pool, v_pool=v_pool, k=np.zeros((2, HKV, D), np.float32))
    args |= dict(slots=np.zeros(2, np.int32)) | change
    with pytest.raises(ValueError, match=message):
        write_kv(
            args["k_pool"], args["v_pool"], args["k"], args["k"], args["slots"], jnp.int32(0),
            impl=IMPL,
        )  # fmt: skip


def test_slot_mapping_value_validation():
    validate_slot_mapping(np.array([0, 23]), NB, BS, L, 2)
    with pytest.raises(ValueError, match=r"slot_mapping\[1\] = 24 is outside the pool's 24"):
        validate_slot_mapping(np.array([0, 24]), NB, BS, L, 0)
    with pytest.raises(ValueError, match=r"slot_mapping\[0\] = -1"):
        validate_slot_mapping(np.array([-1]), NB, BS, L, 0)
    with pytest.raises(ValueError, match=r"layer = 3 is outside \[0, num_layers=3\)"):
        validate_slot_mapping(np.array([0]), NB, BS, L, 3)
