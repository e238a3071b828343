"""Vectorized, jittable jnp reference of ragged paged attention.

Every token gathers all `max_blocks` pages of its sequence, so memory grows as
T * max_blocks * block_size * num_kv_heads * head_dim: right for decode (one token per sequence)
and for tests, wasteful for long prefill chunks. Arithmetic is float32 at HIGHEST precision;
quantized (int8, float8) pools are dequantized as they are gathered (kv_cache.dequantize_kv).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jserve.pallas.kv_cache import dequantize_kv
from jserve.pallas.ragged_common import (
    MASK_VALUE,
    RaggedCall,
    allowed,
    cap_scores,
    online_softmax_finish,
    token_seq_ids,
)


@jax.jit
def ragged_paged_attention_reference(
    call: RaggedCall,
) -> jax.Array:
    """The jnp reference (see `ragged_paged_attention`); padded tokens' outputs are 0."""
    num_tokens, _, head_dim = call.q.shape
    num_kv_heads, group = call.dims.num_kv_heads, call.dims.group_size
    seq = token_seq_ids(call.cu_q_lens, call.num_seqs, num_tokens)  # [T], S for padding tokens
    is_real = seq < call.dims.max_seqs
    seq = jnp.minimum(seq, call.dims.max_seqs - 1)
    q_start, q_len = call.cu_q_lens[seq], call.cu_q_lens[seq + 1] - call.cu_q_lens[seq]
    kv_len = jnp.where(is_real, call.kv_lens[seq], 0)  # [T]; 0 masks every position
    row_ctx = kv_len - q_len + jnp.arange(num_tokens, dtype=jnp.int32) - q_start  # [T]

    tables = jnp.where(is_real[:, None], call.block_tables[seq], 0)  # padding reads only the sink

    def gather(pool: jax.Array, scales: jax.Array | None) -> jax.Array:
        pages = pool[call.layer, tables]  # [T, max_blocks, Hkv, block_size, D]
        if scales is None:
            pages = pages.astype(jnp.float32)
        else:  # quantized pools: each token's row times its scale
            pages = dequantize_kv(pages, scales[call.layer, tables])
        pages = pages.transpose(0, 2, 1, 3, 4)
        return pages.reshape(num_tokens, num_kv_heads, -1, head_dim)  # [T, Hkv, positions, D]

    k_scales, v_scales = call.kv_scales or (None, None)
    k, v = gather(call.k_pool, k_scales), gather(call.v_pool, v_scales)
    pos = jnp.arange(k.shape[2], dtype=jnp.int32)
    mask = allowed(pos, row_ctx[:, None], kv_len[:, None], call.sliding_window)  # [T, positions]
    mask = mask[:, None, None, :]  # [T, 1, 1, positions]
    v = jnp.where((pos < kv_len[:, None])[:, None, :, None], v, 0.0)

    qg = (
        call.q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
        * call.sm_scale
    )
    hi = lax.Precision.HIGHEST
    scores = cap_scores(jnp.einsum("thgd,thkd->thgk", qg, k, precision=hi), call.soft_cap)
    scores = jnp.where(mask, scores, MASK_VALUE)
    p = jnp.where(mask, jnp.exp(scores - scores.max(axis=-1, keepdims=True)), 0.0)
    acc = jnp.einsum("thgk,thkd->thgd", p, v, precision=hi)
    out = online_softmax_finish(p.sum(axis=-1, keepdims=True), acc)
    return out.reshape(call.q.shape).astype(call.q.dtype)
