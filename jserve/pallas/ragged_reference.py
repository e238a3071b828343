"""Vectorized, jittable jnp reference of ragged paged attention.

Every token gathers all `max_blocks` pages of its sequence, so memory grows as
T * max_blocks * block_size * num_kv_heads * head_dim: right for decode (one token per sequence)
and for tests, wasteful for long prefill chunks. Arithmetic is float32 at HIGHEST precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from jserve.pallas.ragged_common import (
    MASK_VALUE,
    allowed,
    cap_scores,
    online_softmax_finish,
    token_seq_ids,
    validate_attention_shapes,
)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "soft_cap"))
def ragged_paged_attention_reference(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, num_blocks, Hkv, block_size, D]
    v_pool: jax.Array,  # [L, num_blocks, Hkv, block_size, D]
    block_tables: jax.Array,  # [S, max_blocks] int32
    cu_q_lens: jax.Array,  # [S + 1] int32
    kv_lens: jax.Array,  # [S] int32
    num_seqs: jax.Array,  # [] or [1] int32
    layer: jax.Array,  # [] int32
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
) -> jax.Array:
    """Same contract as `ragged_paged_attention`; padded tokens' outputs are 0."""
    dims = validate_attention_shapes(
        q, k_pool, v_pool, block_tables, cu_q_lens, kv_lens, num_seqs, layer,
        sm_scale, sliding_window, soft_cap,
    )  # fmt: skip
    num_tokens, _, head_dim = q.shape
    num_kv_heads, group = dims.num_kv_heads, dims.group_size
    seq = token_seq_ids(cu_q_lens, num_seqs, num_tokens)  # [T], S for padding tokens
    is_real = seq < dims.max_seqs
    seq = jnp.minimum(seq, dims.max_seqs - 1)
    q_start, q_len = cu_q_lens[seq], cu_q_lens[seq + 1] - cu_q_lens[seq]
    kv_len = jnp.where(is_real, kv_lens[seq], 0)  # [T]; 0 masks every position
    row_ctx = kv_len - q_len + jnp.arange(num_tokens, dtype=jnp.int32) - q_start  # [T]

    tables = jnp.where(is_real[:, None], block_tables[seq], 0)  # padding reads only the sink

    def gather(pool: jax.Array) -> jax.Array:  # -> [T, Hkv, max_blocks * block_size, D]
        pages = pool[layer, tables]  # [T, max_blocks, Hkv, block_size, D]
        pages = pages.astype(jnp.float32).transpose(0, 2, 1, 3, 4)
        return pages.reshape(num_tokens, num_kv_heads, -1, head_dim)

    k, v = gather(k_pool), gather(v_pool)
    pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    mask = allowed(pos, row_ctx[:, None], kv_len[:, None], sliding_window)  # [T, positions]
    mask = mask[:, None, None, :]  # [T, 1, 1, positions]
    v = jnp.where((pos < kv_len[:, None])[:, None, :, None], v, 0.0)

    qg = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim) * sm_scale
    hi = lax.Precision.HIGHEST
    scores = cap_scores(jnp.einsum("thgd,thkd->thgk", qg, k, precision=hi), soft_cap)
    scores = jnp.where(mask, scores, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    acc = jnp.einsum("thgk,thkd->thgd", p, v, precision=hi)
    out = online_softmax_finish(p.sum(axis=-1, keepdims=True), acc)
    return out.reshape(q.shape).astype(q.dtype)
