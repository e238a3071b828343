"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Grid `(KV head, query block)`: query blocks are aligned `block_q`-token blocks of the global
token axis, so the q and output tiles are ordinary pipelined BlockSpecs and no two programs
write the same rows. A block may hold rows of several sequences (decode: one row each); the
program loops over those sequences and, for each, over chunks of `pages_per_chunk` pages of its
KV head, copied HBM -> VMEM by DMA into a two-slot buffer (chunk c + 1 is in flight while chunk
c is computed). Sequence lengths, block tables (flattened: SMEM pads 2-D arrays) and each
block's first/last sequence are scalar-prefetched into SMEM. Per-row metadata (owning sequence,
last visible position) comes precomputed as int32 [rows, 1] tiles, which keeps integer division
out of the kernel. Rows no sequence owns keep a zero denominator and come out exactly 0.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

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
    token_seq_ids,
)

DEFAULT_BLOCK_Q = 16  # tokens per query block: block_q * group rows, a multiple of 16
DEFAULT_PAGES_PER_CHUNK = 4


def validate_mosaic_config(dims: RaggedDims, block_q: int, pages_per_chunk: int) -> None:
    """Static checks of TPU tiling rules; raises ValueError."""
    check_tile_options(block_q=block_q, pages_per_chunk=pages_per_chunk)
    if (block_q * dims.group_size) % 16:
        raise ValueError(
            f"block_q * group_size = {block_q} * {dims.group_size} must be a multiple of 16 "
            "(TPU sublane tiling of the query tile)"
        )
    if dims.block_size % 16:
        raise ValueError(f"block_size ({dims.block_size}) must be a multiple of 16 on TPU")


def _kernel(
    # Scalar prefetch (SMEM):
    cu_q_lens_ref,  # [S + 1]
    kv_lens_ref,  # [S]
    tables_ref,  # [S * max_blocks_padded] flattened block tables
    layer_ref,  # [1]
    first_seq_ref,  # [num_q_blocks] first sequence with rows in the block
    last_seq_ref,  # [num_q_blocks] last one (< first when the block is padding)
    # Inputs:
    q_ref,  # VMEM [block_q * group, D] rows (token, head in group) of one KV head
    row_seq_ref,  # VMEM [block_q * group, 1] owning sequence of each row (S: none)
    row_ctx_ref,  # VMEM [block_q * group, 1] last position each row may see
    k_hbm,  # HBM [L, num_blocks, Hkv, block_size, D]
    v_hbm,  # HBM [L, num_blocks, Hkv, block_size, D]
    # Output:
    o_ref,  # VMEM [block_q * group, D]
    # Scratch:
    k_buf,  # VMEM [2, pages_per_chunk, block_size, D]
    v_buf,  # VMEM [2, pages_per_chunk, block_size, D]
    sems,  # DMA semaphores [2 (k, v), 2 (slot)]
    *,
    dims: RaggedDims,
    block_q: int,
    pages_per_chunk: int,
    table_stride: int,
    sm_scale: float,
    sliding_window: int | None,
    soft_cap: float | None,
):
    head, block = pl.program_id(0), pl.program_id(1)
    chunk = pages_per_chunk * dims.block_size
    layer = layer_ref[0]
    # Scaled in float32, then back to the pool dtype: bf16 pools feed the MXU bf16 x bf16.
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(k_buf.dtype)
    row_seq, row_ctx = row_seq_ref[...], row_ctx_ref[...]

    def copies(seq, c, slot):
        """The 2 * pages_per_chunk DMAs that bring chunk c of `seq` into buffer `slot`."""
        out = []
        for j in range(pages_per_chunk):
            page = tables_ref[seq * table_stride + c * pages_per_chunk + j]
            for kind, (src, dst) in enumerate(((k_hbm, k_buf), (v_hbm, v_buf))):
                out.append(
                    pltpu.make_async_copy(
                        src.at[layer, page, head], dst.at[slot, j], sems.at[kind, slot]
                    )
                )
        return out

    def seq_step(seq, carry):
        q_start = cu_q_lens_ref[seq]
        q_len, kv_len = cu_q_lens_ref[seq + 1] - q_start, kv_lens_ref[seq]
        t_first = jnp.maximum(q_start, block * block_q)
        t_last = jnp.minimum(q_start + q_len, (block + 1) * block_q) - 1
        first_ctx = kv_len - q_len + t_first - q_start
        lo = 0 if sliding_window is None else jnp.maximum(first_ctx - sliding_window + 1, 0)
        # lax.div / lax.rem: operands are >= 0, and jnp's floor division lowers through `sign`,
        # which Mosaic only lowers knowing the TPU generation.
        c_lo = lax.div(lo, chunk)
        last_ctx = kv_len - q_len + t_last - q_start
        c_hi = jnp.where(t_last >= t_first, lax.div(last_ctx, chunk) + 1, c_lo)

        @pl.when(c_lo < c_hi)
        def _():
            for cp in copies(seq, c_lo, 0):
                cp.start()

        def chunk_step(c, carry):
            slot = lax.rem(c - c_lo, 2)
            for cp in copies(seq, c, slot):
                cp.wait()

            @pl.when(c + 1 < c_hi)
            def _():
                for cp in copies(seq, c + 1, 1 - slot):
                    cp.start()

            k = k_buf[slot].reshape(chunk, dims.head_dim)
            v = v_buf[slot].reshape(chunk, dims.head_dim)
            live = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0) < kv_len
            v = jnp.where(live, v, jnp.zeros_like(v))
            scores = cap_scores(qk(q, k), soft_cap)  # [rows, C] float32
            pos = c * chunk + lax.broadcasted_iota(jnp.int32, (1, chunk), 1)
            mask = allowed(pos, row_ctx, kv_len, sliding_window) & (row_seq == seq)
            return online_softmax_step(carry, scores, mask, v)

        return lax.fori_loop(c_lo, c_hi, chunk_step, carry)

    init = online_softmax_init((q.shape[0],), dims.head_dim)
    _, denom, acc = lax.fori_loop(first_seq_ref[block], last_seq_ref[block] + 1, seq_step, init)
    o_ref[...] = online_softmax_finish(denom, acc).astype(o_ref.dtype)


def _row_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens, group):
    """Per-token owner sequence and last visible position, each row repeated per head."""
    max_seqs = kv_lens.shape[0]
    seq = token_seq_ids(cu_q_lens, num_seqs, num_tokens)
    real = seq < max_seqs
    s = jnp.minimum(seq, max_seqs - 1)
    ctx = kv_lens[s] - (cu_q_lens[s + 1] - cu_q_lens[s]) + jnp.arange(num_tokens) - cu_q_lens[s]
    ctx = jnp.where(real, ctx, -1).astype(jnp.int32)
    return seq, jnp.repeat(seq, group)[:, None], jnp.repeat(ctx, group)[:, None]


@functools.partial(jax.jit, static_argnames=("block_q", "pages_per_chunk", "interpret"))
def ragged_paged_attention_mosaic(
    call: RaggedCall,
    *,
    block_q: int = DEFAULT_BLOCK_Q,
    pages_per_chunk: int = DEFAULT_PAGES_PER_CHUNK,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention by the Mosaic kernel (interpret=True: the TPU interpreter on CPU);
    see `ragged_paged_attention` for the call. Padded tokens' outputs are exactly 0."""
    validate_mosaic_config(call.dims, block_q, pages_per_chunk)
    hkv, group, d = call.dims.num_kv_heads, call.dims.group_size, call.dims.head_dim
    num_blocks_q = pl.cdiv(call.dims.num_tokens, block_q)
    padded_tokens = num_blocks_q * block_q
    rows = block_q * group
    # [T, Hq, D] -> [Hkv, padded_tokens * group, D], row = token * group + head in group.
    qt = jnp.pad(call.q, ((0, padded_tokens - call.dims.num_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(padded_tokens, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv, -1, d)
    token_seq, row_seq, row_ctx = _row_metadata(
        call.cu_q_lens, call.kv_lens, call.num_seqs, padded_tokens, group
    )
    starts = jnp.arange(num_blocks_q) * block_q
    last_token = jnp.minimum(starts + block_q, call.cu_q_lens[call.num_seqs.reshape(())]) - 1
    first_seq = token_seq[starts]
    last_seq = jnp.where(last_token >= starts, token_seq[jnp.maximum(last_token, 0)], first_seq - 1)
    tables = pad_table_columns(call.block_tables, pages_per_chunk)
    kernel = functools.partial(
        _kernel,
        dims=call.dims,
        block_q=block_q,
        pages_per_chunk=pages_per_chunk,
        table_stride=tables.shape[1],
        sm_scale=call.sm_scale,
        sliding_window=call.sliding_window,
        soft_cap=call.soft_cap,
    )
    rows_spec = pl.BlockSpec((rows, 1), lambda h, i, *_: (i, 0))
    tile_spec = pl.BlockSpec((None, rows, d), lambda h, i, *_: (h, i, 0))
    page_buf = pltpu.VMEM((2, pages_per_chunk, call.dims.block_size, d), call.k_pool.dtype)
    out = pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(hkv, num_blocks_q),
            in_specs=[
                tile_spec,
                rows_spec,
                rows_spec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=tile_spec,
            scratch_shapes=[page_buf, page_buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=jax.ShapeDtypeStruct(qt.shape, call.q.dtype),
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(
        call.cu_q_lens, call.kv_lens, tables.reshape(-1), call.layer.reshape(1),
        first_seq, last_seq, qt, row_seq, row_ctx, call.k_pool, call.v_pool,
    )  # fmt: skip
    out = out.reshape(hkv, padded_tokens, group, d)[:, : call.dims.num_tokens]
    return out.transpose(1, 0, 2, 3).reshape(call.dims.num_tokens, hkv * group, d)
