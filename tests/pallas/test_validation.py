"""Validators name the offending argument and value; kernel tiling rules are checked up front."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from jserve.pallas.ragged_common import check_tile_options, validate_attention_shapes
from jserve.pallas.ragged_mosaic import validate_mosaic_config
from jserve.pallas.ragged_triton import validate_triton_config
from tests.pallas.ragged_cases import Geometry, build_case

CASE = build_case([(1, 17), (3, 40)], Geometry())  # T=7, S=4, max_blocks=4, 9 pool blocks


def _shape_args(**change):
    names = ("q", "k_pool", "v_pool", "block_tables", "cu_q_lens", "kv_lens", "num_seqs", "layer")
    args = {name: jnp.asarray(a) for name, a in zip(names, CASE.args("xla"), strict=True)}
    args |= dict(sm_scale=0.125, sliding_window=None, soft_cap=None, impl="xla")
    return args | change


def test_each_impl_takes_only_its_own_pool_layout():
    """Mosaic reads head_dim 64 pools two tokens to a 128-lane row; the canonical layout (every
    other implementation's) is refused, naming the shape it wants."""
    _, k_pool, v_pool, *_ = CASE.args("mosaic")
    packed = dict(k_pool=jnp.asarray(k_pool), v_pool=jnp.asarray(v_pool))
    assert packed["k_pool"].shape == (2, 9, 3, 8, 128)
    dims = validate_attention_shapes(**_shape_args(**packed, impl="mosaic"))
    assert (dims.block_size, dims.head_dim, dims.tokens_per_row) == (16, 64, 2)
    wants_packed = r"impl='mosaic' .* is \[2, 9, 3, 8, 128\], got \[2, 9, 3, 16"
    with pytest.raises(ValueError, match=wants_packed):
        validate_attention_shapes(**_shape_args(impl="mosaic"))
    with pytest.raises(ValueError, match=r"impl='xla' .* is \[2, 9, 3, 16, 64\], got \[2, 9, 3, 8"):
        validate_attention_shapes(**_shape_args(**packed))


def test_valid_shapes_give_the_sizes():
    dims = validate_attention_shapes(**_shape_args())
    assert (dims.num_tokens, dims.num_q_heads, dims.head_dim) == (7, 9, 64)
    assert (dims.num_layers, dims.num_kv_heads, dims.block_size) == (2, 3, 16)
    assert (dims.max_seqs, dims.max_blocks, dims.group_size) == (4, 4, 3)


f32, i32 = jnp.float32, jnp.int32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(q=jnp.zeros((7, 9), f32)), r"q must be \[T, num_q_heads, head_dim\]; got shape \[7,"),
        (dict(q=jnp.zeros((7, 8, 64), f32)), r"num_q_heads \(8\) must be a multiple of num_kv_h"),
        (dict(q=jnp.zeros((7, 9, 32), f32)), r"head_dim 32 .* is \[2, 9, 3, 32, 32\], got \[2, 9"),
        (dict(q=jnp.zeros((7, 9, 48), f32)), r"head_dim 48 and these pools that is None"),
        (dict(q=jnp.zeros((7, 9, 64), jnp.bfloat16)), "got q bfloat16, k_pool float32"),
        (dict(v_pool=jnp.zeros((2, 9, 3, 16), f32)), "k_pool and v_pool must both"),
        (dict(block_tables=jnp.zeros((4, 4), jnp.float32)), "block_tables must be int32"),
        (dict(cu_q_lens=jnp.zeros(4, i32)), r"cu_q_lens must be int32 \[5\]; got int32 \[4\]"),
        (dict(kv_lens=jnp.zeros(5, i32)), r"kv_lens must be int32 \[4\]"),
        (dict(num_seqs=jnp.zeros(2, i32)), "num_seqs must be an int32 scalar or"),
        (dict(layer=jnp.zeros(1, i32)), r"layer must be an int32 scalar; got int32 \[1\]"),
        (dict(sm_scale=0.0), "sm_scale must be a positive Python float; got 0.0"),
        (dict(sliding_window=0), "sliding_window must be None or an int >= 1; got 0"),
        (dict(soft_cap=-1.0), "soft_cap must be None or a positive float; got -1.0"),
    ],
)  # fmt: skip
def test_shape_validation_messages(change, message):
    with pytest.raises(ValueError, match=message):
        validate_attention_shapes(**_shape_args(**change))


def test_interpret_config():
    check_tile_options(block_q=32, pages_per_chunk=8)
    with pytest.raises(ValueError, match="block_q must be an int >= 1; got 0"):
        check_tile_options(block_q=0, pages_per_chunk=8)


def test_triton_config_needs_powers_of_two():
    dims = validate_attention_shapes(**_shape_args())
    validate_triton_config(dims, 8, 4, 8)
    with pytest.raises(ValueError, match="pages_per_chunk must be a power of two; got 3"):
        validate_triton_config(dims, 8, 3, 8)
    with pytest.raises(ValueError, match=r"'pages_per_chunk \* block_size': 8"):
        validate_triton_config(dims._replace(block_size=8), 8, 1, 8)
    with pytest.raises(ValueError, match="'head_dim': 80"):
        validate_triton_config(dims._replace(head_dim=80), 8, 4, 8)
    with pytest.raises(ValueError, match="num_kv_splits must be an int >= 1; got 0"):
        validate_triton_config(dims, 8, 4, 0)


def test_mosaic_config_needs_sublane_tiles():
    dims = validate_attention_shapes(**_shape_args())
    validate_mosaic_config(dims, 16, 4)
    with pytest.raises(
        ValueError, match=r"block_q \* group_size = 4 \* 3 must be a multiple of 16"
    ):
        validate_mosaic_config(dims, 4, 4)
    with pytest.raises(ValueError, match=r"block_size \(8\) must be a multiple of 16"):
        validate_mosaic_config(dims._replace(block_size=8), 16, 4)
