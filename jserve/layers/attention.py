"""The one attention entry point of the model.

The model calls `attention(...)` once per layer with this step's queries, keys and values and an
attention-metadata object; which implementation runs is decided by the metadata's type, at trace
time. `DenseCausal` (one sequence, no KV cache) is the plain path used for single-sequence
reference runs; `PagedAttentionMetadata` writes this step's K/V into the block pool and runs
ragged paged attention over it (the serving path).

Under tensor parallelism (`PagedAttentionMetadata.heads`) the KV write and the attention run
per shard inside a `shard_map` over the mesh's head axis: each device sees only its own KV heads
(and their query heads) of this step and of the pool, and no implementation has to be
partitionable by XLA (a Pallas kernel is not): attention needs no communication at all.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jserve.config.engine_args import AttentionImpl, KVCacheDtype
from jserve.pallas import choose_impl, ragged_paged_attention, write_kv_cache
from jserve.pallas.kv_cache import kv_cache_dtype_of, rotate_heads
from jserve.pallas.ragged_common import dot_precision


@jax.tree_util.register_static
@dataclass(frozen=True)
class DenseCausal:
    """One sequence laid out on the token axis from position 0; no cache is read or written.

    Tokens past the real length may be padding: causality keeps them out of real rows.
    """


@dataclass(frozen=True)
class HeadSharding:
    """Heads (query and KV) and the KV pool's head axis are split over `axis` of `mesh`."""

    mesh: jax.sharding.Mesh
    axis: str


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class PagedAttentionMetadata:
    """Where this step's tokens live in the block pool. S is the padded sequence bucket."""

    slot_mapping: jax.Array  # [T] int32 flat pool slot of each token (pads: the sink block)
    block_tables: jax.Array  # [S, max_blocks] int32 (unused entries: the sink block)
    cu_q_lens: jax.Array  # [S + 1] int32 token offsets of each sequence on the T axis
    kv_lens: jax.Array  # [S] int32 context length including this step's tokens
    num_seqs: jax.Array  # [1] int32 real sequences
    impl: AttentionImpl = dataclasses.field(default=AttentionImpl.AUTO, metadata={"static": True})
    heads: HeadSharding | None = dataclasses.field(default=None, metadata={"static": True})
    # The platform the step is compiled for (None: JAX's default backend), which may be a chip
    # this process lacks: kernels for it are then compiled natively, not interpreted.
    platform: str | None = dataclasses.field(default=None, metadata={"static": True})


def attention(
    q: jax.Array,  # [T, Hq, D]
    k: jax.Array,  # [T, Hkv, D]
    v: jax.Array,  # [T, Hkv, D]
    kv_cache: Any,  # whatever the metadata's implementation carries (None for DenseCausal)
    meta: Any,
    layer: jax.Array,  # int32 scalar: this layer's index into a cache with a layer axis
    *,
    sm_scale: float,
    sliding_window: int | None = None,
) -> tuple[jax.Array, Any]:
    """Returns (out [T, Hq, D], updated kv_cache)."""
    if isinstance(meta, DenseCausal):
        return dense_causal_attention(q, k, v, sm_scale, sliding_window), kv_cache
    if isinstance(meta, PagedAttentionMetadata):
        paged = functools.partial(
            _paged_attention, sm_scale=sm_scale, sliding_window=sliding_window, impl=meta.impl,
            platform=meta.platform,
        )  # fmt: skip
        if meta.heads is not None:
            paged = _per_head_shard(paged, meta.heads, kv_cache)
        tables = (meta.slot_mapping, meta.block_tables, meta.cu_q_lens, meta.kv_lens)
        return paged(q, k, v, kv_cache, *tables, meta.num_seqs, layer)
    raise TypeError(f"no attention implementation for metadata of type {type(meta).__name__}")


def _paged_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    kv_cache: tuple[jax.Array, ...],  # (k_pool, v_pool), and quantized pools' (k_scales, v_scales)
    slot_mapping: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    layer: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None,
    impl: AttentionImpl,
    platform: str | None,
) -> tuple[jax.Array, tuple[jax.Array, ...]]:
    # int8 or float8 pools and their scales, or pools of the model's dtype
    kv_dtype = kv_cache_dtype_of(kv_cache[0].dtype) if len(kv_cache) == 4 else KVCacheDtype.AUTO
    # The pools' layout is the resolved implementation's.
    if impl == AttentionImpl.AUTO:
        impl = choose_impl(platform, q.dtype, kv_dtype)
    rotated = kv_dtype != KVCacheDtype.AUTO
    if rotated:  # quantized pools hold K and V rotated (dot products unchanged), and so is out
        q, k, v = rotate_heads(q), rotate_heads(k), rotate_heads(v)
    kv_cache = write_kv_cache(kv_cache, k, v, slot_mapping, layer, impl=impl)
    k_pool, v_pool, *scales = kv_cache
    out = ragged_paged_attention(
        q, k_pool, v_pool, block_tables, cu_q_lens, kv_lens, num_seqs, layer,
        sm_scale=sm_scale, sliding_window=sliding_window, impl=impl, platform=platform,
        kv_scales=tuple(scales) or None,
    )  # fmt: skip
    return (rotate_heads(out) if rotated else out), kv_cache


def _per_head_shard(paged: Any, heads: HeadSharding, kv_cache: tuple[jax.Array, ...]) -> Any:
    """`paged` run on each device's heads: q/k/v and the KV cache (pools, and scales) split on
    their head axis, the step's tables replicated. check_vma is off: kernels (pallas_call)
    carry no varying-axis types, and every output is split, so there is no replication claim
    to check."""
    tokens_heads = P(None, heads.axis, None)  # q [T, Hq, D], k and v [T, Hkv, D]
    # kv_cache_shape's (and kv_scales_shape's) head axis, in every layout
    cache = tuple(P(None, None, heads.axis, *[None] * (x.ndim - 3)) for x in kv_cache)
    replicated = P()
    return jax.shard_map(
        paged,
        mesh=heads.mesh,
        in_specs=(tokens_heads, tokens_heads, tokens_heads, cache, *[replicated] * 6),
        out_specs=(tokens_heads, cache),
        check_vma=False,
    )


def dense_causal_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, sm_scale: float, sliding_window: int | None
) -> jax.Array:
    """Causal attention of one sequence against itself, softmax in float32."""
    t, hq, d = q.shape
    hkv = k.shape[1]
    qg = q.reshape(t, hkv, hq // hkv, d)  # [T, Hkv, G, D]
    scores = jnp.einsum(
        "TKGD,SKD->KGTS", qg, k, precision=dot_precision(qg, k), preferred_element_type=jnp.float32
    )
    scores = scores * sm_scale
    i = jnp.arange(t)[:, None]
    j = jnp.arange(t)[None, :]
    visible = j <= i
    if sliding_window is not None:
        visible &= i - j < sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("KGTS,SKD->TKGD", probs, v, precision=dot_precision(probs, v))
    return out.reshape(t, hq, d)
