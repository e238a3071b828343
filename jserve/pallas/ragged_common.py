"""Pieces every ragged paged attention implementation shares.

The operation: queries of several sequences are concatenated on one token axis. Sequence `s`
owns query rows `cu_q_lens[s]:cu_q_lens[s + 1]` and has `kv_lens[s]` cached positions (this
step's included), reached through `block_tables[s]`. Its query `i` attends to KV positions
`p` with `p <= kv_lens[s] - q_len[s] + i` (and `p > that - sliding_window` with a window).

Masking rules every kernel follows, so NaN in memory it must not read can never leak:
- scores of disallowed positions are replaced (not added to) by `MASK_VALUE`, and their
  probabilities are set to exactly 0;
- V rows at positions `>= kv_lens[s]` (stale slots, sink pages) are zeroed before `p @ v`,
  because `0 * NaN` is NaN; in a layout with several tokens per pool row (Mosaic's, see
  `kv_cache`), K's lanes of those positions too, since a live token's row holds them;
- a row that sees no position (padding) keeps a zero denominator and its output is exactly 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jserve.config.engine_args import AttentionImpl, KVCacheDtype
from jserve.pallas.kv_cache import (
    SCALE_DTYPE,
    kv_cache_dtype_of,
    kv_cache_shape,
    kv_scales_shape,
)

# Finite so that `m_prev - m_new` is 0 (not NaN) while a row has seen nothing yet.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
# The implementations that read quantized pools and their scales (kv_cache: --kv-cache-dtype
# int8 and the fp8 ones): every one for the reference, XLA's loops and Triton; the native CPU
# kernel int8 only (the CPU has no float8 storage to serve).
QUANTIZED_KV_IMPLS = (
    AttentionImpl.REFERENCE, AttentionImpl.XLA, AttentionImpl.NATIVE, AttentionImpl.TRITON
)  # fmt: skip
_NATIVE_READS = (KVCacheDtype.INT8,)


def quantized_kv_impls(kv_cache_dtype: str) -> tuple[AttentionImpl, ...]:
    """The implementations that read pools of the quantized `kv_cache_dtype` with their
    scales."""
    if kv_cache_dtype in _NATIVE_READS:
        return QUANTIZED_KV_IMPLS
    return tuple(impl for impl in QUANTIZED_KV_IMPLS if impl != AttentionImpl.NATIVE)


class RaggedDims(NamedTuple):
    """Static sizes of one ragged paged attention call."""

    num_tokens: int  # T, padded token bucket
    num_q_heads: int  # Hq
    head_dim: int  # D
    num_layers: int  # L
    num_blocks: int  # pool blocks, block 0 is the sink
    num_kv_heads: int  # Hkv
    block_size: int  # tokens per block
    max_seqs: int  # S, padded sequence bucket
    max_blocks: int  # block table columns per sequence
    tokens_per_row: int = 1  # p: tokens side by side in one pool row (kv_cache.kv_tokens_per_row)

    @property
    def group_size(self) -> int:
        """Query heads per KV head (the GQA ratio)."""
        return self.num_q_heads // self.num_kv_heads


def _check_int_vector(name: str, x: jax.Array, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape or x.dtype != jnp.int32:
        raise ValueError(f"{name} must be int32 {list(shape)}; got {x.dtype} {list(x.shape)}")


def check_tile_options(**options: int) -> None:
    """Static checks every kernel makes of its tiling options: each must be an int >= 1."""
    for name, value in options.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be an int >= 1; got {value!r}")


def _pool_layout(shape: tuple[int, ...], head_dim: int, impl: str) -> tuple[int, int]:
    """(block_size, tokens per row) of a pool of `shape`; ValueError unless it is laid out as
    `impl` reads it (kv_cache_shape)."""
    num_layers, num_blocks, num_kv_heads, pool_rows, row_width = shape
    tokens_per_row = max(1, row_width // head_dim)
    block_size = pool_rows * tokens_per_row
    want = kv_cache_shape(
        num_layers, num_blocks, block_size, num_kv_heads, head_dim, impl=impl
    ) if row_width % head_dim == 0 else None  # fmt: skip
    if tuple(shape) != want:
        raise ValueError(
            f"impl={impl!r} reads pools laid out as kv_cache_shape(..., impl={impl!r}); for "
            f"q's head_dim {head_dim} and these pools that is {want and list(want)}, got "
            f"{list(shape)}"
        )
    return block_size, tokens_per_row


def validate_attention_shapes(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    kv_lens: jax.Array,
    num_seqs: jax.Array,
    layer: jax.Array,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
    impl: str,
    kv_scales: tuple[jax.Array, jax.Array] | None = None,
) -> RaggedDims:
    """Static checks (shapes, dtypes, options, the pools' layout for implementation `impl`,
    a quantized pool's scales); returns the sizes. Raises ValueError."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, num_q_heads, head_dim]; got shape {list(q.shape)}")
    if k_pool.ndim != 5 or k_pool.shape != v_pool.shape:
        raise ValueError(
            "k_pool and v_pool must both have the kv_cache_shape layout "
            "[num_layers, num_blocks, num_kv_heads, block_size / p, head_dim * p]; "
            f"got k_pool {list(k_pool.shape)} and v_pool {list(v_pool.shape)}"
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_layers, num_blocks, num_kv_heads, _, _ = k_pool.shape
    block_size, tokens_per_row = _pool_layout(k_pool.shape, head_dim, impl)
    if num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads ({num_q_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if kv_scales is None:
        _check_dtypes(q, k_pool, v_pool)
    else:
        _check_quantized(q, k_pool, v_pool, kv_scales, block_size, impl)
    if block_tables.ndim != 2 or block_tables.dtype != jnp.int32:
        raise ValueError(
            "block_tables must be int32 [max_seqs, max_blocks]; "
            f"got {block_tables.dtype} {list(block_tables.shape)}"
        )
    max_seqs, max_blocks = block_tables.shape
    _check_int_vector("cu_q_lens", cu_q_lens, (max_seqs + 1,))
    _check_int_vector("kv_lens", kv_lens, (max_seqs,))
    if num_seqs.size != 1 or num_seqs.ndim > 1 or num_seqs.dtype != jnp.int32:
        raise ValueError(
            f"num_seqs must be an int32 scalar or [1]; got {num_seqs.dtype} {list(num_seqs.shape)}"
        )
    if layer.ndim != 0 or layer.dtype != jnp.int32:
        raise ValueError(f"layer must be an int32 scalar; got {layer.dtype} {list(layer.shape)}")
    _check_options(sm_scale, sliding_window, soft_cap)
    return RaggedDims(
        num_tokens, num_q_heads, head_dim, num_layers, num_blocks, num_kv_heads, block_size,
        max_seqs, max_blocks, tokens_per_row,
    )  # fmt: skip


def _check_dtypes(q: jax.Array, k_pool: jax.Array, v_pool: jax.Array) -> None:
    dtypes = {q.dtype, k_pool.dtype, v_pool.dtype}
    if len(dtypes) != 1 or q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(
            f"q, k_pool and v_pool must share one of {[str(d) for d in SUPPORTED_DTYPES]} "
            f"(or the pools be int8 with kv_scales, or float8 with them); got q {q.dtype}, "
            f"k_pool {k_pool.dtype}, v_pool {v_pool.dtype}"
        )


def _check_quantized(
    q: jax.Array,
    k_pool: jax.Array,
    v_pool: jax.Array,
    kv_scales: tuple[jax.Array, jax.Array],
    block_size: int,
    impl: str,
) -> None:
    """A quantized pool's checks: q a float dtype, both pools int8 or both one float8, both
    scales float32 in the pools' layout without head_dim (kv_cache.kv_scales_shape), an
    implementation that reads them."""
    kv_cache_dtype = kv_cache_dtype_of(k_pool.dtype)
    readers = quantized_kv_impls(kv_cache_dtype)
    if kv_cache_dtype != KVCacheDtype.AUTO and impl not in readers:
        names = [str(name) for name in readers]
        raise ValueError(f"{kv_cache_dtype} KV pools are read by impl {names}; got impl={impl!r}")
    num_layers, num_blocks, num_kv_heads = k_pool.shape[:3]
    want = kv_scales_shape(num_layers, num_blocks, block_size, num_kv_heads)
    scales = [(tuple(s.shape), s.dtype) for s in kv_scales]
    if (
        q.dtype not in SUPPORTED_DTYPES
        or kv_cache_dtype == KVCacheDtype.AUTO
        or v_pool.dtype != k_pool.dtype
        or len(scales) != 2
        or set(scales) != {(want, SCALE_DTYPE)}
    ):
        raise ValueError(
            f"quantized pools are int8 or float8 with two float32 kv_scales {list(want)} and q "
            f"one of {[str(d) for d in SUPPORTED_DTYPES]}; got q {q.dtype}, pools "
            f"{k_pool.dtype} and {v_pool.dtype}, kv_scales {scales}"
        )


def _check_options(sm_scale: float, sliding_window: int | None, soft_cap: float | None) -> None:
    if not isinstance(sm_scale, int | float) or not sm_scale > 0:
        raise ValueError(f"sm_scale must be a positive Python float; got {sm_scale!r}")
    if sliding_window is not None and (not isinstance(sliding_window, int) or sliding_window < 1):
        raise ValueError(f"sliding_window must be None or an int >= 1; got {sliding_window!r}")
    if soft_cap is not None and (not isinstance(soft_cap, int | float) or not soft_cap > 0):
        raise ValueError(f"soft_cap must be None or a positive float; got {soft_cap!r}")


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedCall:
    """One validated ragged paged attention call: the contract every implementation takes.

    `ragged_paged_attention` builds it once (`RaggedCall.make` runs the static validators), and
    each implementation is a jitted `fn(call, *, <its tiling options>)`, so the interface
    lives here alone: a new argument is one field, read only by the implementations that use it.
    Arrays are pytree data; the options and sizes are static (part of the jit cache key).
    """

    q: jax.Array  # [T, Hq, D]
    k_pool: jax.Array  # [L, num_blocks, Hkv, block_size / p, D * p] (kv_cache_shape)
    v_pool: jax.Array  # same
    block_tables: jax.Array  # [S, max_blocks] int32
    cu_q_lens: jax.Array  # [S + 1] int32
    kv_lens: jax.Array  # [S] int32
    num_seqs: jax.Array  # [] or [1] int32
    layer: jax.Array  # [] int32
    # quantized pools: (k_scales, v_scales) [L, num_blocks, Hkv, block_size] float32; else None
    kv_scales: tuple[jax.Array, jax.Array] | None
    sm_scale: float = dataclasses.field(metadata={"static": True})
    sliding_window: int | None = dataclasses.field(metadata={"static": True})
    soft_cap: float | None = dataclasses.field(metadata={"static": True})
    dims: RaggedDims = dataclasses.field(metadata={"static": True})

    @classmethod
    def make(
        cls,
        q: jax.Array,
        k_pool: jax.Array,
        v_pool: jax.Array,
        block_tables: jax.Array,
        cu_q_lens: jax.Array,
        kv_lens: jax.Array,
        num_seqs: jax.Array,
        layer: jax.Array,
        *,
        sm_scale: float,
        sliding_window: int | None = None,
        soft_cap: float | None = None,
        impl: str,
        kv_scales: tuple[jax.Array, jax.Array] | None = None,
    ) -> RaggedCall:
        """Validate the arguments for implementation `impl` (ValueError naming the offender)
        and bundle them."""
        arrays = (q, k_pool, v_pool, block_tables, cu_q_lens, kv_lens, num_seqs, layer)
        dims = validate_attention_shapes(
            *arrays, sm_scale, sliding_window, soft_cap, impl, kv_scales
        )
        return cls(*arrays, kv_scales, sm_scale=sm_scale, sliding_window=sliding_window,
                   soft_cap=soft_cap, dims=dims)  # fmt: skip


def cap_scores(scores: jax.Array, soft_cap: float | None) -> jax.Array:
    """Gemma-style logit soft cap: soft_cap * tanh(scores / soft_cap)."""
    if soft_cap is None:
        return scores
    return soft_cap * jnp.tanh(scores / soft_cap)


def allowed(
    pos: jax.Array, row_ctx: jax.Array, kv_len: jax.Array, sliding_window: int | None
) -> jax.Array:
    """Which (row, position) pairs may attend; broadcasts `pos [.., 1, C]` and `row_ctx [.., M, 1]`.

    `row_ctx` is the last position each query row may see; `pos < kv_len` keeps rows beyond a
    sequence's queries (block padding) away from stale slots.
    """
    mask = (pos <= row_ctx) & (pos < kv_len)
    if sliding_window is not None:
        mask &= pos > row_ctx - sliding_window
    return mask


def _batch_dims(x: jax.Array) -> tuple[int, ...]:
    return tuple(range(x.ndim - 2))


def qk(q: jax.Array, k: jax.Array) -> jax.Array:
    """Scores `[..., M, D] x [..., C, D] -> [..., M, C]` in float32 (k not transposed)."""
    b = _batch_dims(q)
    dims = (((q.ndim - 1,), (k.ndim - 1,)), (b, b))
    precision = dot_precision(q, k)
    return lax.dot_general(q, k, dims, precision=precision, preferred_element_type=jnp.float32)


def pv(p: jax.Array, v: jax.Array) -> jax.Array:
    """Weighted values `[..., M, C] x [..., C, D] -> [..., M, D]` in float32."""
    b = _batch_dims(p)
    dims = (((p.ndim - 1,), (v.ndim - 2,)), (b, b))
    p = p.astype(v.dtype)
    return lax.dot_general(
        p, v, dims, precision=dot_precision(p, v), preferred_element_type=jnp.float32
    )


def online_softmax_step(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    scores: jax.Array,  # [..., M, C] float32, already scaled and capped
    mask: jax.Array,  # [..., M, C] bool
    v: jax.Array,  # [..., C, D], zeroed at positions >= kv_len
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention update of (max [.., M, 1], denominator [.., M, 1], acc [.., M, D])."""
    m_prev, denom_prev, acc_prev = carry
    scores = jnp.where(mask, scores, MASK_VALUE)
    m_next = jnp.maximum(m_prev, scores.max(axis=-1, keepdims=True))
    alpha = jnp.exp(m_prev - m_next)
    p = jnp.where(mask, jnp.exp(scores - m_next), 0.0)
    denom_next = alpha * denom_prev + p.sum(axis=-1, keepdims=True)
    return m_next, denom_next, alpha * acc_prev + pv(p, v)


def online_softmax_init(rows_shape: tuple[int, ...], head_dim: int):
    """Initial (running max, denominator, acc) for rows of shape `rows_shape` (ending in M)."""
    m = jnp.full((*rows_shape, 1), MASK_VALUE, jnp.float32)
    denom = jnp.zeros((*rows_shape, 1), jnp.float32)
    return m, denom, jnp.zeros((*rows_shape, head_dim), jnp.float32)


def online_softmax_finish(denom: jax.Array, acc: jax.Array) -> jax.Array:
    """acc / denom, with rows that saw nothing (denom == 0) exactly 0."""
    return jnp.where(denom > 0, acc / jnp.where(denom > 0, denom, 1.0), 0.0)


def pad_rows(x: jax.Array, rows: int) -> jax.Array:
    """Append `rows` zero rows on axis 0 so fixed-size row blocks never run off the end."""
    return jnp.pad(x, ((0, rows),) + ((0, 0),) * (x.ndim - 1))


def dot_precision(*operands: jax.Array) -> lax.Precision | None:
    """HIGHEST where an operand is float32, so float32 is multiplied in float32 on every backend
    (DEFAULT lets a GPU use TF32 and a TPU bfloat16 passes: on an H200 float32 attention then
    missed float64 by 5e-4 relative, 50x its tolerance); None otherwise (Mosaic refuses HIGHEST
    on bfloat16, which needs no more than one pass anyway)."""
    return lax.Precision.HIGHEST if any(x.dtype == jnp.float32 for x in operands) else None


def pad_table_columns(block_tables: jax.Array, multiple: int) -> jax.Array:
    """Pad block tables with sink entries (0) to a multiple of `multiple` columns."""
    return jnp.pad(block_tables, ((0, 0), (0, -block_tables.shape[1] % multiple)))


def token_seq_ids(cu_q_lens: jax.Array, num_seqs: jax.Array, num_tokens: int) -> jax.Array:
    """[T] sequence of each token; tokens past cu_q_lens[num_seqs] get the padding id S.

    Only cu_q_lens[:num_seqs + 1] is read, so padded sequences' entries may hold anything.
    """
    n = num_seqs.reshape(())
    max_seqs = cu_q_lens.shape[0] - 1
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    ends = jnp.where(jnp.arange(max_seqs) < n, cu_q_lens[1:], jnp.iinfo(jnp.int32).max)
    seq = jnp.searchsorted(ends, tokens, side="right").astype(jnp.int32)
    return jnp.where(tokens < cu_q_lens[n], seq, max_seqs)
