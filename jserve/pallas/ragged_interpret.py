"""Coarse-grid Pallas kernel for ragged paged attention, written for CPU interpret mode.

Interpret mode turns the grid into a serial XLA while loop and every kernel op into ordinary XLA
ops, so what costs time is the number of loop iterations and ops, not parallelism. Hence:
- one program per sequence (padded sequences exit at once); inside it a `fori_loop` over query
  blocks and, per block, a `fori_loop` over chunks of `pages_per_chunk` pages with an online
  softmax; trip counts are dynamic, so short sequences cost little;
- decode rows (q_len == 1) take a one-row path, longer chunks `block_q`-row blocks;
- each chunk does all KV heads at once as head-batched matmuls on [Hkv, rows, C] operands
  (a page of the pool layout is [Hkv, block_size, D], so pages concatenate without a transpose);
- the pools are `memory_space=pl.ANY` refs read with `.at`-style indexing at the traced layer,
  so no layer slice is copied (timing does not grow with pool size).
The output buffer aliases a zero input: rows no sequence owns (padding tokens) stay exactly 0.
A block's rows past its sequence's end are restored from the buffer before the store, so a
block never clobbers the next sequence's rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jserve.pallas.ragged_common import (
    RaggedCall,
    RaggedDims,
    allowed,
    cap_scores,
    check_tile_options,
    online_softmax_finish,
    online_softmax_init,
    online_softmax_step,
    pad_rows,
    pad_table_columns,
    qk,
)

# Chosen by a sweep with SmolLM2's shapes (block 16) on a CPU: 8 pages per chunk was the
# fastest of 4, 8 and 16 at decode, and block_q 16-128 made no difference on a mixed batch
# beyond load noise.
DEFAULT_PAGES_PER_CHUNK = 8
DEFAULT_BLOCK_Q = 32


class _Options(NamedTuple):
    """The kernel's static options (see ragged_paged_attention_interpret)."""

    dims: RaggedDims
    block_q: int
    pages_per_chunk: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


class _Seq(NamedTuple):
    """The sequence one program serves: its index, its first row on T, its query and context
    lengths, and the layer to read (all traced scalars)."""

    index: jax.Array
    q_start: jax.Array
    q_len: jax.Array
    kv_len: jax.Array
    layer: jax.Array


def _kernel(
    # Inputs, all whole arrays (pl.ANY):
    cu_q_lens_ref,  # [S + 1]
    kv_lens_ref,  # [S]
    tables_ref,  # [S, max_blocks padded to a multiple of pages_per_chunk]
    num_seqs_ref,  # [1]
    layer_ref,  # [1]
    q_ref,  # [T + block_q, Hq, D]
    k_ref,  # [L, num_blocks, Hkv, block_size, D]
    v_ref,  # [L, num_blocks, Hkv, block_size, D]
    zeros_ref,  # [T + block_q, Hq, D], aliased to o_ref
    # Output:
    o_ref,  # [T + block_q, Hq, D]
    *,
    opts: _Options,
):
    del zeros_ref  # Only its aliasing matters: o_ref starts as zeros.
    index = pl.program_id(0)
    refs = (q_ref, k_ref, v_ref, tables_ref)
    block_q = opts.block_q

    @pl.when(index < num_seqs_ref[0])
    def _():
        q_start = cu_q_lens_ref[index]
        seq = _Seq(index, q_start, cu_q_lens_ref[index + 1] - q_start, kv_lens_ref[index],
                   layer_ref[0])  # fmt: skip

        @pl.when(seq.q_len == 1)
        def _decode():
            out = _attend(refs, seq, 0, 1, opts)
            o_ref[pl.ds(q_start, 1)] = out.astype(o_ref.dtype)

        @pl.when(seq.q_len > 1)
        def _prefill():
            def block_step(b, carry):
                q0 = b * block_q
                out = _attend(refs, seq, q0, block_q, opts).astype(o_ref.dtype)
                rows = pl.ds(q_start + q0, block_q)
                mine = (q0 + lax.broadcasted_iota(jnp.int32, (block_q, 1, 1), 0)) < seq.q_len
                o_ref[rows] = jnp.where(mine, out, o_ref[rows])
                return carry

            lax.fori_loop(0, pl.cdiv(seq.q_len, block_q), block_step, 0)


def _attend(refs: tuple, seq: _Seq, q0: jax.Array | int, rows: int, opts: _Options) -> jax.Array:
    """Outputs [rows, Hq, D] (float32) of query rows q0 .. q0 + rows - 1 of `seq`: an online
    softmax over its pages in chunks of `pages_per_chunk`, within its causal (and sliding)
    window. `refs` are the kernel's (q, k pool, v pool, block tables)."""
    q_ref, k_ref, v_ref, tables_ref = refs
    dims, pages_per_chunk = opts.dims, opts.pages_per_chunk
    num_kv_heads, group, head_dim = dims.num_kv_heads, dims.group_size, dims.head_dim
    chunk = pages_per_chunk * dims.block_size
    q_len, kv_len, layer = seq.q_len, seq.kv_len, seq.layer
    q = q_ref[pl.ds(seq.q_start + q0, rows)].astype(jnp.float32) * opts.sm_scale  # [rows, Hq, D]
    # Row r of a head group is query token r % rows: [Hkv, group * rows, D].
    q = q.reshape(rows, num_kv_heads, group, head_dim).transpose(1, 2, 0, 3)
    q = q.reshape(num_kv_heads, group * rows, head_dim)
    first_ctx = kv_len - q_len + q0  # last position the first row may see
    row_ctx = first_ctx + lax.broadcasted_iota(jnp.int32, (group * rows, 1), 0) % rows
    last_ctx = jnp.minimum(first_ctx + rows, kv_len) - 1
    window = opts.sliding_window
    lo = 0 if window is None else jnp.maximum(first_ctx - window + 1, 0)

    def chunk_step(c, carry):
        pages = tables_ref[seq.index, pl.ds(c * pages_per_chunk, pages_per_chunk)]
        k = jnp.concatenate([k_ref[layer, pages[j]] for j in range(pages_per_chunk)], 1)
        v = jnp.concatenate([v_ref[layer, pages[j]] for j in range(pages_per_chunk)], 1)
        pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)  # [1, C]
        v = jnp.where((pos < kv_len)[..., None], v.astype(jnp.float32), 0.0)
        scores = cap_scores(qk(q, k.astype(jnp.float32)), opts.soft_cap)  # [Hkv, rows*G, C]
        mask = allowed(pos, row_ctx, kv_len, window)  # [rows*G, C]
        return online_softmax_step(carry, scores, mask, v)

    init = online_softmax_init((num_kv_heads, group * rows), head_dim)
    _, denom, acc = lax.fori_loop(lo // chunk, last_ctx // chunk + 1, chunk_step, init)
    out = online_softmax_finish(denom, acc).reshape(num_kv_heads, group, rows, head_dim)
    return out.transpose(2, 0, 1, 3).reshape(rows, num_kv_heads * group, head_dim)


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_chunk"))
def ragged_paged_attention_interpret(
    call: RaggedCall,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    pages_per_chunk: int = DEFAULT_PAGES_PER_CHUNK,
) -> jax.Array:
    """Ragged paged attention by the coarse-grid kernel in interpret mode (CPU); see
    `ragged_paged_attention` for the call. Padded tokens' outputs are exactly 0."""
    check_tile_options(block_q=block_q, pages_per_chunk=pages_per_chunk)
    q_padded = pad_rows(call.q, block_q)
    opts = _Options(
        call.dims, block_q, pages_per_chunk, call.sm_scale, call.sliding_window, call.soft_cap
    )
    kernel = functools.partial(_kernel, opts=opts)
    whole = pl.BlockSpec(memory_space=pl.ANY)
    out = pl.pallas_call(
        kernel,
        grid=(call.dims.max_seqs,),
        in_specs=[whole] * 9,
        out_specs=whole,
        out_shape=jax.ShapeDtypeStruct(q_padded.shape, call.q.dtype),
        input_output_aliases={8: 0},
        interpret=True,
    )(
        call.cu_q_lens,
        call.kv_lens,
        pad_table_columns(call.block_tables, pages_per_chunk),
        call.num_seqs.reshape(1),
        call.layer.reshape(1),
        q_padded,
        call.k_pool,
        call.v_pool,
        jnp.zeros_like(q_padded),
    )
    return out[: call.dims.num_tokens]
