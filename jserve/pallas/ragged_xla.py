"""Ragged paged attention in plain XLA ops: the CPU serving path (Pallas only interprets there).

Work is cut into row groups that each read one sequence's pages:
- decode rows: each sequence with q_len == 1 is one group of one query row. Decode sequences
  are packed first (`jnp.nonzero` with a static size), so the loop runs exactly once per decode
  sequence of the step;
- prefill items: each sequence with q_len > 1 is cut into `block_q`-row query blocks, so the
  rows of an item share every page they read (one K/V fetch serves block_q x group rows).
Each group loops over `chunk_pages`-page KV chunks, only from its first to its last visible
position: trip counts follow the step's real context (and the causal diagonal), never the block
table's width, and a loop over zero groups costs nothing, so a decode-only step pays nothing for
the prefill loop and the reverse. A chunk is fetched as per-page dynamic slices concatenated on
the token axis (a page of the pool layout is [Hkv, block_size, D], so no transpose; a quantized
pool's pages are dequantized with their scales' pages); XLA fuses them into one copy that stays
in cache, then two head-batched dots and an online-softmax update (the masking rules of
ragged_common) finish the chunk. Results land on the token axis with a
dynamic update per group; rows no sequence owns stay exactly 0.

Why not one big gather per step: materializing every sequence's K/V up to a shared bound
(bench.kernel_timings measured the jnp reference, which gathers whole block tables) writes as many
bytes as it reads and loses to reading each page straight into a cache-sized chunk.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jserve.pallas.kv_cache import dequantize_kv
from jserve.pallas.ragged_common import (
    RaggedCall,
    RaggedDims,
    allowed,
    cap_scores,
    check_tile_options,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_table_columns,
    qk,
)

DEFAULT_CHUNK_PAGES = 4
DEFAULT_BLOCK_Q = 32


def _cdiv(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def _attend_group(
    q: jax.Array,  # [Hkv, M, D] float32, already scaled; row r is query token r % rows
    row_ctx: jax.Array,  # [M, 1] last position each row may see (-1: sees nothing)
    kv_len: jax.Array,  # [] the sequence's context length
    table: jax.Array,  # [max_blocks padded to a multiple of chunk_pages] the sequence's pages
    pools: tuple[jax.Array, ...],  # k_pool, v_pool (and a quantized pool's k_scales, v_scales)
    layer: jax.Array,  # []
    lo: jax.Array,  # [] first position any row needs
    hi: jax.Array,  # [] one past the last position any row needs
    *,
    dims: RaggedDims,
    chunk_pages: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> jax.Array:
    """Online-softmax attention of one sequence's row group; returns [Hkv, M, D] float32."""
    chunk = chunk_pages * dims.block_size
    k_pool, v_pool, *scales = pools
    k_scales, v_scales = scales or (None, None)

    def tiles(pool: jax.Array, pages: jax.Array) -> jax.Array:  # -> [Hkv, chunk, ...]
        pool_layer = lax.dynamic_index_in_dim(pool, layer, 0, keepdims=False)
        tiles = [
            lax.dynamic_index_in_dim(pool_layer, pages[j], 0, keepdims=False)
            for j in range(chunk_pages)
        ]
        return jnp.concatenate(tiles, axis=1)

    def fetch(pool: jax.Array, scale: jax.Array | None, pages: jax.Array) -> jax.Array:
        """[Hkv, chunk, D] float32; a quantized pool's rows times their tokens' scales."""
        if scale is None:
            return tiles(pool, pages).astype(jnp.float32)
        return dequantize_kv(tiles(pool, pages), tiles(scale, pages))

    def chunk_step(c, carry):
        pages = lax.dynamic_slice_in_dim(table, c * chunk_pages, chunk_pages)
        k, v = fetch(k_pool, k_scales, pages), fetch(v_pool, v_scales, pages)
        pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)  # [1, C]
        v = jnp.where((pos < kv_len)[..., None], v, 0.0)  # stale slots may hold NaN
        scores = cap_scores(qk(q, k), soft_cap)  # [Hkv, M, C]
        mask = allowed(pos, row_ctx, kv_len, sliding_window)  # [M, C]
        return online_softmax_step(carry, scores, mask, v)

    init = online_softmax_init(q.shape[:2], dims.head_dim)
    _, denom, acc = lax.fori_loop(lo // chunk, _cdiv(hi, chunk), chunk_step, init)
    return online_softmax_finish(denom, acc)


class _Step(NamedTuple):
    """What the decode and prefill loops of one call share."""

    call: RaggedCall
    qs: jax.Array  # [T + bq, Hq, D] float32 scaled queries, bq zero rows appended
    q_start: jax.Array  # [S]
    q_len: jax.Array  # [S], 0 for padded sequences
    kv_len: jax.Array  # [S], 0 for padded sequences
    tables: jax.Array  # [S, max_blocks padded to chunk_pages]
    bq: int
    chunk_pages: int

    @classmethod
    def make(cls, call: RaggedCall, block_q: int, chunk_pages: int) -> _Step:
        check_tile_options(block_q=block_q, chunk_pages=chunk_pages)
        real = jnp.arange(call.dims.max_seqs) < call.num_seqs.reshape(())
        q_start = call.cu_q_lens[:-1]
        bq = min(block_q, call.dims.num_tokens)
        # Room for a whole block past the last token, so an item's block never runs off the end.
        qs = jnp.pad(call.q.astype(jnp.float32) * call.sm_scale, ((0, bq), (0, 0), (0, 0)))
        return cls(
            call, qs, q_start,
            q_len=jnp.where(real, call.cu_q_lens[1:] - q_start, 0),  # padded: no rows
            kv_len=jnp.where(real, call.kv_lens, 0),
            tables=pad_table_columns(call.block_tables, chunk_pages),
            bq=bq, chunk_pages=chunk_pages,
        )  # fmt: skip

    def window_start(self, first_ctx: jax.Array) -> jax.Array:
        window = self.call.sliding_window
        return 0 if window is None else jnp.maximum(first_ctx - window + 1, 0)

    def attend(self, q, row_ctx, seq, lo, hi) -> jax.Array:
        call = self.call
        return _attend_group(
            q, row_ctx, self.kv_len[seq], self.tables[seq],
            (call.k_pool, call.v_pool, *(call.kv_scales or ())),
            call.layer, lo, hi, dims=call.dims, chunk_pages=self.chunk_pages,
            sliding_window=call.sliding_window, soft_cap=call.soft_cap,
        )  # fmt: skip


def _decode_rows(st: _Step, out: jax.Array) -> jax.Array:
    """Writes the row of every sequence with q_len == 1 into `out` [T + bq, Hq, D]."""
    hkv, group, d = st.call.dims.num_kv_heads, st.call.dims.group_size, st.call.dims.head_dim
    is_decode = st.q_len == 1
    (decode_seqs,) = jnp.nonzero(is_decode, size=st.call.dims.max_seqs, fill_value=0)

    def decode_step(i, out):
        seq = decode_seqs[i]
        row, kv = st.q_start[seq], st.kv_len[seq]
        qg = lax.dynamic_index_in_dim(st.qs, row, 0, False).reshape(hkv, group, d)
        ctx = jnp.full((group, 1), kv - 1)
        res = st.attend(qg, ctx, seq, st.window_start(kv - 1), kv)
        return lax.dynamic_update_index_in_dim(out, res.reshape(1, hkv * group, d), row, 0)

    return lax.fori_loop(0, is_decode.sum(), decode_step, out)


def _prefill_rows(st: _Step, out: jax.Array) -> jax.Array:
    """Writes the rows of every sequence with q_len > 1 into `out` [T + bq, Hq, D]."""
    if st.call.dims.num_tokens == 1:  # a one-token step has no prefill rows
        return out
    hkv, group, d = st.call.dims.num_kv_heads, st.call.dims.group_size, st.call.dims.head_dim
    bq = st.bq
    blocks = jnp.where(st.q_len > 1, _cdiv(st.q_len, bq), 0)
    ends = jnp.cumsum(blocks)

    def item_step(i, out):
        seq = jnp.searchsorted(ends, i, side="right").astype(jnp.int32)
        q0 = (i - (ends[seq] - blocks[seq])) * bq  # first row of the item in its sequence
        first, kv, n = st.q_start[seq] + q0, st.kv_len[seq], st.q_len[seq]
        rows = lax.dynamic_slice_in_dim(st.qs, first, bq)  # [bq, Hq, D]
        # Row r of a head group is query token r % bq: [Hkv, group * bq, D].
        qg = rows.reshape(bq, hkv, group, d).transpose(1, 2, 0, 3).reshape(hkv, -1, d)
        token = q0 + lax.broadcasted_iota(jnp.int32, (group * bq, 1), 0) % bq
        ctx = jnp.where(token < n, kv - n + token, -1)  # rows past the sequence see nothing
        first_ctx = kv - n + q0
        hi = jnp.minimum(first_ctx + bq, kv)
        res = st.attend(qg, ctx, seq, st.window_start(first_ctx), hi)
        res = res.reshape(hkv, group, bq, d).transpose(2, 0, 1, 3).reshape(bq, -1, d)
        # Rows past the sequence's end belong to the next sequence (or padding): keep them.
        mine = (q0 + lax.broadcasted_iota(jnp.int32, (bq, 1, 1), 0)) < n
        kept = lax.dynamic_slice_in_dim(out, first, bq)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(mine, res, kept), first, 0)

    return lax.fori_loop(0, ends[-1], item_step, out)


@functools.partial(jax.jit, static_argnames=("block_q", "chunk_pages"))
def ragged_paged_attention_xla(
    call: RaggedCall,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    chunk_pages: int = DEFAULT_CHUNK_PAGES,
) -> jax.Array:
    """Ragged paged attention in XLA ops; see `ragged_paged_attention` for the call.
    Padded tokens' outputs are exactly 0."""
    st = _Step.make(call, block_q, chunk_pages)
    t, hq, d = call.q.shape
    out = jnp.zeros((t + st.bq, hq, d), jnp.float32)
    out = _prefill_rows(st, _decode_rows(st, out))
    return out[:t].astype(call.q.dtype)
