"""The paged KV pool: its layout (one per attention implementation), and the write of one
step's K/V into it.

Layout (owned by `kv_cache_shape`; every implementation reads the pool as it asks for it):

    k_pool, v_pool: [num_layers, num_blocks, num_kv_heads, block_size / p, head_dim * p]

where p (`kv_tokens_per_row`) is how many tokens one row holds side by side: 1 (the canonical
layout [L, blocks, heads, block_size, head_dim]) for every implementation but the Mosaic (TPU)
kernel with a head_dim below a TPU vector's 128 lanes, which packs 128 / head_dim tokens per
row. Either way the packed pool is the canonical one reshaped in row-major order (row r of a
block holds tokens p r .. p r + p - 1), so the bytes are the same; only the shape differs.

Why this order:
- The layer axis leads so the model's `lax.scan` carries the whole pool and each layer touches
  only `pool[layer]` through a traced index (no per-layer copy of a pool slice).
- The block axis comes next, so one block of one layer is a single contiguous run
  (num_kv_heads * block_size * head_dim elements): the CPU paths fetch a page for
  all heads with one dynamic slice, and pages concatenate along the token axis straight into the
  [num_kv_heads, tokens, head_dim] operand of a head-batched matmul, with no transpose.
- Heads come before tokens inside a block, so one (block, head) tile is contiguous: a GPU
  program serving one KV head reads whole contiguous rows (coalesced) and a TPU kernel DMAs
  whole tiles without lane slicing.
- Rows of 128 lanes on TPU: a TPU array's minor dimension is tiled by 128 lanes, so a minor
  dimension of 64 would make XLA pick a transposed layout for the pool (blocks minor-most,
  which wastes nothing) and copy the whole pool into the kernel's row-major layout around
  every call: about twice the pool in scratch. Packed rows are already the kernel's layout.
- K and V are two arrays of the same shape: the write is two scatters, the attention reads both.
Block 0 is the sink: pad tokens write there and padded table entries point there.

Quantized pools (`--kv-cache-dtype int8`, `fp8_e4m3`, `fp8_e5m2`): K and V are one byte
each (int8, or float8 where the backend stores it) in the same layout, and beside
each pool lies one float32 scale per (layer, block, KV head, token), [L, num_blocks, Hkv,
block_size] (`kv_scales_shape`): the pool's layout without head_dim, read through the same block
tables, in every implementation's layout. A token's D values are x = q * scale with q in
[-Q, Q] and scale = max |x| / Q (symmetric absmax over head_dim, `quantize_kv`): Q is 127 for
int8 (q rounded to an integer), the format's largest finite value for float8 (448 for e4m3,
57344 for e5m2; q rounded to the nearest float8). Per token
rather than per block because a token is written once and never changes: the write quantizes
only its own values, where a block-wide scale would have to be raised, and the block's earlier
tokens requantized, whenever a later token's values are larger (a read-modify-write of the
whole block at every append). The scales cost 4 bytes per token and head beside head_dim's
bytes (68 against 256 float32 bytes at head_dim 64: 3.76x the blocks for the same memory).
The KV cache is then the tuple (k_pool, v_pool, k_scales, v_scales); unquantized, (k_pool,
v_pool); the pools' element dtype tells which quantization (`kv_cache_dtype_of`). What a
quantized pool holds is K and V rotated by a Hadamard matrix (`rotate_heads`, the attention
layer's job), which spreads K's outlier channels over all of them before the per-token scale
is taken (for float8 a smaller gain, measured on the model: docs/quantization.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jserve.config.engine_args import AttentionImpl, KVCacheDtype

LANES, SUBLANES = 128, 8  # a TPU vector register's (8, 128) tile: the tile of every TPU array
QUANT_DTYPE = jnp.dtype(jnp.int8)  # an int8 pool's elements
SCALE_DTYPE = jnp.dtype(jnp.float32)  # their scales, one per (layer, block, KV head, token)
# Each quantized --kv-cache-dtype's pool elements; the first name of a dtype is its own.
QUANTIZED_POOL_DTYPES = {
    KVCacheDtype.INT8: QUANT_DTYPE,
    KVCacheDtype.FP8_E4M3: jnp.dtype(jnp.float8_e4m3fn),
    KVCacheDtype.FP8: jnp.dtype(jnp.float8_e4m3fn),  # vLLM's spelling of fp8_e4m3
    KVCacheDtype.FP8_E5M2: jnp.dtype(jnp.float8_e5m2),
}
_INT8_QMAX = 127.0


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: jnp.dtype) -> jnp.dtype:
    """The dtype of the K and V pools: the model's for "auto", else the quantized element."""
    if kv_cache_dtype == KVCacheDtype.AUTO:
        return jnp.dtype(model_dtype)
    if kv_cache_dtype in QUANTIZED_POOL_DTYPES:
        return QUANTIZED_POOL_DTYPES[KVCacheDtype(kv_cache_dtype)]
    names = ", ".join(str(name) for name in KVCacheDtype)
    raise ValueError(f"kv_cache_dtype must be one of {names}; got {kv_cache_dtype!r}")


def kv_cache_dtype_of(pool_dtype: jnp.dtype) -> KVCacheDtype:
    """The --kv-cache-dtype whose pools have elements of `pool_dtype`: AUTO for a float pool
    (the model's dtype), else the quantized one's (fp8_e4m3 for float8_e4m3fn, not fp8)."""
    pool_dtype = jnp.dtype(pool_dtype)
    names = [name for name, dtype in QUANTIZED_POOL_DTYPES.items() if dtype == pool_dtype]
    return names[0] if names else KVCacheDtype.AUTO


def kv_scales_shape(
    num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int
) -> tuple[int, int, int, int]:
    """Shape of each of the K and V scales of a quantized pool (see the module docstring)."""
    return (num_layers, num_blocks, num_kv_heads, block_size)


def quantize_kv(x: jax.Array, dtype: jnp.dtype = QUANT_DTYPE) -> tuple[jax.Array, jax.Array]:
    """x [..., D] -> (q [..., D] of `dtype`, float32 scales [...]) with x ~ q * scale: symmetric
    absmax over the last axis, the absmax on the format's largest value (127 for int8, the
    float8 format's largest finite one), rounded to nearest. An all-zero row gets scale 0 and
    zeros. `dtype` is int8 or a float8 (QUANTIZED_POOL_DTYPES)."""
    dtype = jnp.dtype(dtype)
    integer = jnp.issubdtype(dtype, jnp.integer)
    qmax = _INT8_QMAX if integer else float(jnp.finfo(dtype).max)
    x = x.astype(jnp.float32)
    scale = jnp.max(jnp.abs(x), axis=-1) / qmax
    safe = jnp.where(scale > 0, scale, 1.0)[..., None]
    scaled = jnp.round(x / safe) if integer else x / safe
    # The clip also keeps float8 finite: x / scale may round just past qmax, and e4m3fn has no
    # infinity, so a value past it would become NaN.
    return jnp.clip(scaled, -qmax, qmax).astype(dtype), scale


def dequantize_kv(q: jax.Array, scale: jax.Array) -> jax.Array:
    """q [..., D] (int8 or float8) and scales [...] -> float32 [..., D]: quantize_kv's
    inverse."""
    return q.astype(jnp.float32) * scale[..., None]


@functools.cache
def _hadamard(head_dim: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order head_dim (a power of two):
    symmetric and its own inverse."""
    h = np.ones((1, 1), np.float32)
    while h.shape[0] < head_dim:
        h = np.block([[h, h], [h, -h]])
    return h / np.float32(np.sqrt(head_dim))


def rotate_heads(x: jax.Array) -> jax.Array:
    """x [..., D] times the orthonormal Hadamard matrix H of order D (D a power of two; other
    head dims are returned as they are). H is its own inverse and keeps dot products
    (Hq . Hk = q . k), so a quantized pool stores K and V rotated: the attention layer
    rotates q, k and v, and its output back. Why: a few channels of K carry
    most of its magnitude, and a per-token absmax scale sized for them leaves the other
    channels a handful of levels; rotated, every channel carries a mix of all of them and the
    int8 steps shrink (on SmolLM2, 3x less KL divergence from the float32 pool at no extra
    bytes; docs/quantization.md)."""
    head_dim = x.shape[-1]
    if head_dim & (head_dim - 1):
        return x
    h = jnp.asarray(_hadamard(head_dim))
    return jnp.dot(x.astype(jnp.float32), h, precision=lax.Precision.HIGHEST).astype(x.dtype)


def kv_tokens_per_row(impl: str, head_dim: int, block_size: int) -> int:
    """Tokens one pool row holds side by side for implementation `impl` (see the module
    docstring): 128 / head_dim for "mosaic" when head_dim divides 128 lanes and a block still
    fills whole 8-row tiles, else 1."""
    if impl == AttentionImpl.AUTO:
        raise ValueError("the KV layout belongs to one implementation: resolve 'auto' first")
    per_row = LANES // head_dim
    packed = impl == AttentionImpl.MOSAIC and head_dim < LANES and LANES % head_dim == 0
    return per_row if packed and block_size % (per_row * SUBLANES) == 0 else 1


def kv_cache_shape(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    impl: str,
) -> tuple[int, int, int, int, int]:
    """Shape of each of the K and V pools as attention implementation `impl` reads them (see
    the module docstring for why this order and when rows hold several tokens)."""
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
    per_row = kv_tokens_per_row(impl, head_dim, block_size)
    return (num_layers, num_blocks, num_kv_heads, block_size // per_row, head_dim * per_row)


def validate_write_kv_shapes(
    k_pool: jax.Array, v_pool: jax.Array, k: jax.Array, v: jax.Array, slot_mapping: jax.Array
) -> int:
    """Static (shape and dtype) checks of `write_kv`'s arguments; returns the tokens per pool
    row (see the module docstring). Raises ValueError."""
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both have the kv_cache_shape layout "
            "[num_layers, num_blocks, num_kv_heads, block_size / p, head_dim * p]; "
            f"got k_pool {k_pool.shape} and v_pool {v_pool.shape}"
        )
    _, _, num_kv_heads, _, row_width = k_pool.shape
    head_dim = k.shape[-1] if k.ndim == 3 else 0
    if k.ndim != 3 or k.shape != v.shape or k.shape[1] != num_kv_heads or row_width % head_dim:
        raise ValueError(
            f"k and v must be [T, num_kv_heads={num_kv_heads}, head_dim] with head_dim "
            f"dividing the pool's rows of {row_width}; got k {k.shape} and v {v.shape}"
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
    return row_width // head_dim


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


# Mosaic's write: each (token, head)'s D values go to (layer, block, head, row, first lane), a
# window along the minor (lane) axis only, so the layout the kernel reads is also the scatter's.
# A window across heads (the canonical write, one per token) made XLA's TPU compiler lay the
# pool out heads-minor for the write and copy it whole around the kernel, at every head_dim. On
# CPU the canonical write is the faster of the two at large steps.
_ROW_WRITE = lax.ScatterDimensionNumbers(
    update_window_dims=(2,),
    inserted_window_dims=(0, 1, 2, 3),
    scatter_dims_to_operand_dims=(0, 1, 2, 3, 4),
)


@functools.partial(jax.jit, static_argnames="impl")
def write_kv(
    k_pool: jax.Array,  # [L, num_blocks, Hkv, block_size / p, D * p] (kv_cache_shape)
    v_pool: jax.Array,  # same
    k: jax.Array,  # [T, Hkv, D] this step's keys
    v: jax.Array,  # [T, Hkv, D] this step's values
    slot_mapping: jax.Array,  # [T] int32 flat slot: block_id * block_size + offset
    layer: jax.Array,  # [] int32 (traced) layer to write
    *,
    impl: str,  # the attention implementation whose layout the pools have (not "auto")
) -> tuple[jax.Array, jax.Array]:
    """Scatter this step's K/V of one layer into the pools and return the new pools.

    Only the T slots of `layer` named by `slot_mapping` change; pad tokens' slots point into the
    sink block 0. Inside a jitted step that donates the pools (or a `lax.scan` carrying them)
    XLA performs the scatter in place. Slots repeated within one call (pad tokens sharing a sink
    slot) keep an unspecified one of their values. Token `offset` of a block is pool row
    offset // p, lanes from (offset % p) * D (kv_cache_shape's p).
    """
    per_row = validate_write_kv_shapes(k_pool, v_pool, k, v, slot_mapping)
    block_size = k_pool.shape[3] * per_row
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    if impl != "mosaic":  # the canonical layout: one [Hkv, D] window per token
        k_pool = k_pool.at[layer, blocks, :, offsets].set(k, mode="drop")
        v_pool = v_pool.at[layer, blocks, :, offsets].set(v, mode="drop")
        return k_pool, v_pool
    num_tokens, num_kv_heads, head_dim = k.shape
    columns = [
        jnp.asarray(layer, jnp.int32),
        blocks[:, None],
        jnp.arange(num_kv_heads, dtype=jnp.int32)[None, :],
        (offsets // per_row)[:, None],
        (offsets % per_row * head_dim)[:, None],
    ]
    shape = (num_tokens, num_kv_heads)
    where = jnp.stack([jnp.broadcast_to(c, shape) for c in columns], axis=-1)  # [T, Hkv, 5]
    mode = lax.GatherScatterMode.FILL_OR_DROP
    k_pool = lax.scatter(k_pool, where, k, _ROW_WRITE, mode=mode)
    v_pool = lax.scatter(v_pool, where, v, _ROW_WRITE, mode=mode)
    return k_pool, v_pool


def write_kv_cache(
    kv_cache: tuple[jax.Array, ...],
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
    layer: jax.Array,
    *,
    impl: str,
) -> tuple[jax.Array, ...]:
    """`write_kv` of this step's K/V into a KV cache, quantized or not (see the module
    docstring): (k_pool, v_pool) as write_kv writes them, or (k_pool, v_pool, k_scales,
    v_scales) with K and V quantized to the pools' element dtype per token and head
    (`quantize_kv`) and each scale written beside its token's slot."""
    if len(kv_cache) == 2:
        return write_kv(*kv_cache, k, v, slot_mapping, layer, impl=impl)
    k_pool, v_pool, k_scales, v_scales = kv_cache
    num_layers, num_blocks, num_kv_heads = k_pool.shape[:3]
    want = kv_scales_shape(num_layers, num_blocks, k_scales.shape[-1], num_kv_heads)
    quantized = kv_cache_dtype_of(k_pool.dtype) != KVCacheDtype.AUTO
    if not quantized or {k_scales.shape, v_scales.shape} != {want}:
        raise ValueError(
            f"a quantized KV cache is int8 or float8 pools and float32 scales {list(want)}; "
            f"got {k_pool.dtype} pools and scales {list(k_scales.shape)}, "
            f"{list(v_scales.shape)}"
        )
    (k8, k_scale), (v8, v_scale) = quantize_kv(k, k_pool.dtype), quantize_kv(v, v_pool.dtype)
    k_pool, v_pool = write_kv(k_pool, v_pool, k8, v8, slot_mapping, layer, impl=impl)
    block_size = k_scales.shape[-1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    k_scales = k_scales.at[layer, blocks, :, offsets].set(k_scale, mode="drop")
    v_scales = v_scales.at[layer, blocks, :, offsets].set(v_scale, mode="drop")
    return k_pool, v_pool, k_scales, v_scales
