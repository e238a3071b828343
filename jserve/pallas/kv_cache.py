"""The paged KV pool: its one layout, and the write of one step's K/V into it.

Layout (owned by `kv_cache_shape`, shared by every attention implementation):

    k_pool, v_pool: [num_layers, num_blocks, num_kv_heads, block_size, head_dim]

Why this order:
- The layer axis leads so the model's `lax.scan` carries the whole pool and each layer touches
  only `pool[layer]` through a traced index (no per-layer copy of a pool slice).
- The block axis comes next, so one block of one layer is a single contiguous run
  (num_kv_heads * block_size * head_dim elements): the CPU paths fetch a page for
  all heads with one dynamic slice, and pages concatenate along the token axis straight into the
  [num_kv_heads, tokens, head_dim] operand of a head-batched matmul, with no transpose.
- Heads come before tokens inside a block, so one (block, head) tile [block_size, head_dim] is
  contiguous: a GPU program serving one KV head reads whole contiguous rows (coalesced) and a TPU
  kernel DMAs whole (block_size, head_dim) tiles without lane slicing.
- K and V are two arrays of the same shape: the write is two scatters, the attention reads both.
Block 0 is the sink: pad tokens write there and padded table entries point there.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def kv_cache_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int
) -> tuple[int, int, int, int, int]:
    """Shape of each of the K and V pools (see the module docstring for why this order)."""
    dims = {
        "num_layers": num_layers,
        "num_blocks": num_blocks,
        "block_size": block_size,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
    }
    bad = {name: value for name, value in dims.items() if int(value) != value or value < 1}
    if bad:
        raise ValueError(f"kv_cache_shape needs positive integers; got {bad}")
    if num_blocks < 2:
        raise ValueError(
            f"num_blocks must be >= 2 (block 0 is the sink, never allocated); got {num_blocks}"
        )
    return (num_layers, num_blocks, num_kv_heads, block_size, head_dim)


def validate_write_kv_shapes(
    k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> None:
    """Static (shape and dtype) checks of `write_kv`'s arguments; raises ValueError."""
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both have the kv_cache_shape layout "
            "[num_layers, num_blocks, num_kv_heads, block_size, head_dim]; "
            f"got k_pool {k_pool.shape} and v_pool {v_pool.shape}"
        )
    _, _, num_kv_heads, _, head_dim = k_pool.shape
    if k.ndim != 3 or k.shape != v.shape or k.shape[1:] != (num_kv_heads, head_dim):
        raise ValueError(
            f"k and v must be [T, num_kv_heads={num_kv_heads}, head_dim={head_dim}]; "
            f"got k {k.shape} and v {v.shape}"
        )
    if slot_mapping.shape != (k.shape[0],) or slot_mapping.dtype != jnp.int32:
        raise ValueError(
            f"slot_mapping must be int32 [T={k.shape[0]}]; "
            f"got {slot_mapping.dtype} {slot_mapping.shape}"
        )
    if k.dtype != k_pool.dtype or v.dtype != v_pool.dtype:
        raise ValueError(
            f"k/v dtypes ({k.dtype}, {v.dtype}) must match the pools' "
            f"({k_pool.dtype}, {v_pool.dtype}); cast before writing"
        )


def validate_slot_mapping(
    slot_mapping: np.ndarray, num_blocks: int, block_size: int, num_layers: int, layer: int
) -> None:
    """Dynamic checks on host values: every slot inside the pool, the layer in range."""
    slots = np.asarray(slot_mapping)
    num_slots = num_blocks * block_size
    bad = np.flatnonzero((slots < 0) | (slots >= num_slots))
    if bad.size:
        raise ValueError(
            f"slot_mapping[{bad[0]}] = {slots[bad[0]]} is outside the pool's "
            f"{num_slots} slots (num_blocks={num_blocks} x block_size={block_size}); "
            "pad tokens must use a slot of the sink block 0"
        )
    if not 0 <= int(layer) < num_layers:
        raise ValueError(f"layer = {int(layer)} is outside [0, num_layers={num_layers})")


@jax.jit
def write_kv(
    k_pool: jax.Array,  # [L, num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [L, num_blocks, Hkv, block_size, D]
    k: jax.Array,  # [T, Hkv, D] this step's keys
    v: jax.Array,  # [T, Hkv, D] this step's values
    slot_mapping: jax.Array,  # [T] int32 flat slot: block_id * block_size + offset
    layer: jax.Array,  # [] int32 (traced) layer to write
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V of one layer into the pools and return the new pools.

    Only the T slots of `layer` named by `slot_mapping` change; pad tokens' slots point into the
    sink block 0. Inside a jitted step that donates the pools (or a `lax.scan` carrying them)
    XLA performs the scatter in place. Slots repeated within one call (pad tokens sharing a sink
    slot) keep an unspecified one of their values.
    """
    validate_write_kv_shapes(k_pool, v_pool, k, v, slot_mapping)
    block_size = k_pool.shape[3]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    # Advanced indices separated by the head slice put the token axis first: [T, Hkv, D].
    k_pool = k_pool.at[layer, blocks, :, offsets].set(k, mode="drop")
    v_pool = v_pool.at[layer, blocks, :, offsets].set(v, mode="drop")
    return k_pool, v_pool
