"""Ragged paged attention as a Pallas TPU (Mosaic) kernel.

Grid `(KV head, query block)`: query blocks are aligned `block_q`-token blocks of the global
token axis, so the q and output tiles are ordinary pipelined BlockSpecs and no two programs
write the same rows. A block may hold rows of several sequences (decode: one row each); the
program loops over those sequences and, for each, over chunks of `pages_per_chunk` pages of its
KV head, copied HBM -> VMEM by DMA into a two-slot buffer (chunk c + 1 is in flight while chunk
c is computed). Sequence lengths, block tables (flattened: SMEM pads 2-D arrays) and each
block's first/last sequence are scalar-prefetched into SMEM. Per-row metadata (owning sequence,
last visible position, part of the pool row) comes precomputed as int32 [rows, 1] tiles, which
keeps integer division out of the kernel.

The pool is read in the layout `kv_cache_shape(..., impl="mosaic")` gives it, so XLA never
copies it around the call: with head_dim below 128 lanes each pool row holds p = 128 / head_dim
tokens side by side. The kernel then works on p copies of the query rows, copy j holding q in
lanes j D .. (j + 1) D and zeros elsewhere: copy j's scores against the packed rows are exactly
those of the tokens in lane part j, and each copy keeps its own online softmax over its own
tokens. The wrapper merges the p partial softmaxes of each row (as flash-decoding merges KV
splits) and takes each copy's own lanes. With p = 1 this is plain flash attention. Rows no
sequence owns keep a zero denominator and come out exactly 0.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

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
    # Inputs (R = p * block_q * group rows: p copies of the (token, head in group) rows):
    q_ref,  # VMEM [R, p * D] rows of one KV head, copy j in lanes j D .. (j + 1) D
    row_seq_ref,  # VMEM [R, 1] owning sequence of each row (S: none)
    row_ctx_ref,  # VMEM [R, 1] last position each row may see
    row_part_ref,  # VMEM [R, 1] the row's copy j: it sees the tokens in lane part j
    k_hbm,  # HBM [L, num_blocks, Hkv, block_size / p, p * D]
    v_hbm,  # HBM [L, num_blocks, Hkv, block_size / p, p * D]
    # Outputs: each row's partial softmax over its lane part's tokens
    acc_ref,  # VMEM [R, p * D] float32 unnormalized
    max_ref,  # VMEM [R, 1] float32 running max
    denom_ref,  # VMEM [R, 1] float32 denominator
    # Scratch:
    k_buf,  # VMEM [2, pages_per_chunk, block_size / p, p * D]
    v_buf,  # VMEM [2, pages_per_chunk, block_size / p, p * D]
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
    # Scaled in float32, then back to the pool dtype: bf16 pools feed the MXU bf16 x bf16.
    q = (q_ref[...].astype(jnp.float32) * sm_scale).astype(k_buf.dtype)
    row_seq, row_ctx, row_part = row_seq_ref[...], row_ctx_ref[...], row_part_ref[...]
    token_of_lane = _token_of_lane(dims, chunk)
    pages = _PageCopies(
        tables_ref, layer_ref[0], head, k_hbm, v_hbm, k_buf, v_buf, sems, pages_per_chunk,
        table_stride,
    )  # fmt: skip
    rows = (q, row_seq, row_ctx, row_part)

    def seq_step(seq, carry):
        kv_len = kv_lens_ref[seq]
        c_lo, c_hi = _chunks_to_read(
            cu_q_lens_ref, kv_len, seq, block, block_q, chunk, sliding_window
        )
        return _attend_chunks(
            seq, kv_len, c_lo, c_hi, carry, rows, pages, token_of_lane, dims, chunk,
            sliding_window, soft_cap,
        )  # fmt: skip

    init = online_softmax_init((q.shape[0],), dims.tokens_per_row * dims.head_dim)
    m, denom, acc = lax.fori_loop(first_seq_ref[block], last_seq_ref[block] + 1, seq_step, init)
    acc_ref[...], max_ref[...], denom_ref[...] = acc, m, denom


def _attend_chunks(
    seq, kv_len, c_lo, c_hi, carry, rows, pages, token_of_lane, dims, chunk, sliding_window,
    soft_cap,
):  # fmt: skip
    """The online softmax of the block's `rows` (q, owning sequence, last visible position,
    lane part) over chunks [c_lo, c_hi) of `seq`'s context, double-buffered: chunk c + 1's
    pages are on their way while chunk c is scored."""
    q, row_seq, row_ctx, row_part = rows
    per_row, width = dims.tokens_per_row, dims.tokens_per_row * dims.head_dim

    @pl.when(c_lo < c_hi)
    def _():
        pages.start(seq, c_lo, 0)

    def chunk_step(c, carry):
        slot = lax.rem(c - c_lo, 2)
        pages.wait(seq, c, slot)

        @pl.when(c + 1 < c_hi)
        def _():
            pages.start(seq, c + 1, 1 - slot)

        k = pages.k_buf[slot].reshape(chunk // per_row, width)
        v = pages.v_buf[slot].reshape(chunk // per_row, width)
        live = c * chunk + token_of_lane < kv_len
        v = jnp.where(live, v, jnp.zeros_like(v))
        if per_row > 1:  # a live token's row may hold a stale one, whose lanes meet q's 0s
            k = jnp.where(live, k, jnp.zeros_like(k))
        scores = cap_scores(qk(q, k), soft_cap)  # [R, C / p] float32
        # Column i of copy j's scores is the chunk's token p i + j.
        first = c * chunk + per_row * lax.broadcasted_iota(jnp.int32, (1, chunk // per_row), 1)
        mask = allowed(first + row_part, row_ctx, kv_len, sliding_window) & (row_seq == seq)
        return online_softmax_step(carry, scores, mask, v)

    return lax.fori_loop(c_lo, c_hi, chunk_step, carry)


def _token_of_lane(dims: RaggedDims, chunk: int) -> jax.Array:
    """Token of (pool row r, lane l) of a chunk, less the chunk's first: p r + (l // D)."""
    per_row, width = dims.tokens_per_row, dims.tokens_per_row * dims.head_dim
    token_of_lane = per_row * lax.broadcasted_iota(jnp.int32, (chunk // per_row, width), 0)
    if per_row > 1:  # D is a power of two here (it divides 128)
        lane = lax.broadcasted_iota(jnp.int32, (chunk // per_row, width), 1)
        token_of_lane += lax.shift_right_logical(lane, dims.head_dim.bit_length() - 1)
    return token_of_lane


def _chunks_to_read(cu_q_lens_ref, kv_len, seq, block, block_q, chunk, sliding_window):
    """[c_lo, c_hi): the chunks of `seq`'s context its rows in query block `block` may see
    (c_lo == c_hi when it has none there)."""
    q_start = cu_q_lens_ref[seq]
    q_len = cu_q_lens_ref[seq + 1] - q_start
    t_first = jnp.maximum(q_start, block * block_q)
    t_last = jnp.minimum(q_start + q_len, (block + 1) * block_q) - 1
    first_ctx = kv_len - q_len + t_first - q_start
    lo = 0 if sliding_window is None else jnp.maximum(first_ctx - sliding_window + 1, 0)
    # lax.div / lax.rem: operands are >= 0, and jnp's floor division lowers through `sign`,
    # which Mosaic only lowers knowing the TPU generation.
    c_lo = lax.div(lo, chunk)
    last_ctx = kv_len - q_len + t_last - q_start
    return c_lo, jnp.where(t_last >= t_first, lax.div(last_ctx, chunk) + 1, c_lo)


@dataclasses.dataclass(frozen=True)
class _PageCopies:
    """The DMAs that bring one chunk of a sequence's pages (this layer, this KV head) from the
    pool in HBM into one of the two VMEM buffers."""

    tables_ref: Any  # SMEM [S * max_blocks_padded] flattened block tables
    layer: Any
    head: Any
    k_hbm: Any
    v_hbm: Any
    k_buf: Any
    v_buf: Any
    sems: Any
    pages_per_chunk: int
    table_stride: int

    def _copies(self, seq, c, slot) -> list:
        out = []
        pairs = ((self.k_hbm, self.k_buf), (self.v_hbm, self.v_buf))
        for j in range(self.pages_per_chunk):
            page = self.tables_ref[seq * self.table_stride + c * self.pages_per_chunk + j]
            for kind, (src, dst) in enumerate(pairs):
                source = src.at[self.layer, page, self.head]
                out.append(pltpu.make_async_copy(source, dst.at[slot, j], self.sems.at[kind, slot]))
        return out

    def start(self, seq, c, slot) -> None:
        for cp in self._copies(seq, c, slot):
            cp.start()

    def wait(self, seq, c, slot) -> None:
        for cp in self._copies(seq, c, slot):
            cp.wait()


def _row_metadata(cu_q_lens, kv_lens, num_seqs, num_tokens, group):
    """Per-token owner sequence, and per row (token, head in group) its owner sequence and last
    visible position, [T * group, 1] each."""
    max_seqs = kv_lens.shape[0]
    seq = token_seq_ids(cu_q_lens, num_seqs, num_tokens)
    real = seq < max_seqs
    s = jnp.minimum(seq, max_seqs - 1)
    ctx = kv_lens[s] - (cu_q_lens[s + 1] - cu_q_lens[s]) + jnp.arange(num_tokens) - cu_q_lens[s]
    ctx = jnp.where(real, ctx, -1).astype(jnp.int32)
    return seq, jnp.repeat(seq, group)[:, None], jnp.repeat(ctx, group)[:, None]


def _copies(x: jax.Array, rows: int, per_row: int) -> jax.Array:
    """[..., n * rows, w] -> [..., n * per_row * rows, w]: each block of `rows` rows repeated
    `per_row` times (the kernel's row copies)."""
    blocks = x.reshape(*x.shape[:-2], -1, 1, rows, x.shape[-1])
    blocks = jnp.broadcast_to(blocks, (*blocks.shape[:-3], per_row, rows, x.shape[-1]))
    return blocks.reshape(*x.shape[:-2], -1, x.shape[-1])


def _spread_lanes(q: jax.Array, rows: int, per_row: int) -> jax.Array:
    """q [Hkv, n * rows, D] -> [Hkv, n * per_row * rows, per_row * D]: copy j of each block
    holds the block in lanes j D .. (j + 1) D and zeros elsewhere."""
    hkv, _, d = q.shape
    blocks = q.reshape(hkv, -1, 1, rows, 1, d)
    eye = jnp.eye(per_row, dtype=q.dtype).reshape(1, 1, per_row, 1, per_row, 1)
    return (blocks * eye).reshape(hkv, -1, per_row * d)


def _merge_copies(acc, m, denom, rows: int, per_row: int, head_dim: int) -> jax.Array:
    """The kernel's per-copy partial softmaxes -> [Hkv, n * rows, D]: copy j's own lanes,
    merged over the copies by their maxima, normalized (rows that saw nothing: exactly 0)."""
    hkv = acc.shape[0]
    acc = acc.reshape(hkv, -1, per_row, rows, per_row, head_dim)
    own = jnp.eye(per_row, dtype=bool).reshape(1, 1, per_row, 1, per_row, 1)
    acc = jnp.where(own, acc, 0.0).sum(axis=4)  # [Hkv, n, p, rows, D]
    m = m.reshape(hkv, -1, per_row, rows, 1)
    weight = jnp.exp(m - m.max(axis=2, keepdims=True))
    denom = (weight * denom.reshape(m.shape)).sum(axis=2)
    out = online_softmax_finish(denom, (weight * acc).sum(axis=2))  # [Hkv, n, rows, D]
    return out.reshape(hkv, -1, head_dim)


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
    dims = call.dims
    validate_mosaic_config(dims, block_q, pages_per_chunk)
    hkv, group, d, per_row = dims.num_kv_heads, dims.group_size, dims.head_dim, dims.tokens_per_row
    num_blocks_q = pl.cdiv(dims.num_tokens, block_q)
    padded_tokens = num_blocks_q * block_q
    rows = block_q * group
    # [T, Hq, D] -> [Hkv, padded_tokens * group, D], row = token * group + head in group.
    qt = jnp.pad(call.q, ((0, padded_tokens - dims.num_tokens), (0, 0), (0, 0)))
    qt = qt.reshape(padded_tokens, hkv, group, d).transpose(1, 0, 2, 3).reshape(hkv, -1, d)
    token_seq, row_seq, row_ctx = _row_metadata(
        call.cu_q_lens, call.kv_lens, call.num_seqs, padded_tokens, group
    )
    part = jnp.arange(per_row, dtype=jnp.int32).reshape(1, per_row, 1, 1)
    row_part = jnp.broadcast_to(part, (num_blocks_q, per_row, rows, 1)).reshape(-1, 1)
    starts = jnp.arange(num_blocks_q) * block_q
    last_token = jnp.minimum(starts + block_q, call.cu_q_lens[call.num_seqs.reshape(())]) - 1
    first_seq = token_seq[starts]
    last_seq = jnp.where(last_token >= starts, token_seq[jnp.maximum(last_token, 0)], first_seq - 1)
    tables = pad_table_columns(call.block_tables, pages_per_chunk)
    operands = (
        call.cu_q_lens, call.kv_lens, tables.reshape(-1), call.layer.reshape(1),
        first_seq, last_seq, _spread_lanes(qt, rows, per_row), _copies(row_seq, rows, per_row),
        _copies(row_ctx, rows, per_row), row_part, call.k_pool, call.v_pool,
    )  # fmt: skip
    acc, m, denom = _call_kernel(
        call, operands, block_q, pages_per_chunk, tables.shape[1], num_blocks_q, interpret
    )
    out = _merge_copies(acc, m, denom, rows, per_row, d).astype(call.q.dtype)
    out = out.reshape(hkv, padded_tokens, group, d)[:, : dims.num_tokens]
    return out.transpose(1, 0, 2, 3).reshape(dims.num_tokens, hkv * group, d)


def _call_kernel(
    call: RaggedCall,
    operands: tuple[jax.Array, ...],
    block_q: int,
    pages_per_chunk: int,
    table_stride: int,
    num_blocks_q: int,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The pallas_call over grid (KV head, query block): each row's partial softmax."""
    dims = call.dims
    kernel = functools.partial(
        _kernel,
        dims=dims,
        block_q=block_q,
        pages_per_chunk=pages_per_chunk,
        table_stride=table_stride,
        sm_scale=call.sm_scale,
        sliding_window=call.sliding_window,
        soft_cap=call.soft_cap,
    )
    copies = dims.tokens_per_row * block_q * dims.group_size
    width = dims.tokens_per_row * dims.head_dim
    rows_spec = pl.BlockSpec((copies, 1), lambda h, i, *_: (i, 0))
    tile_spec = pl.BlockSpec((None, copies, width), lambda h, i, *_: (h, i, 0))
    stat_spec = pl.BlockSpec((None, copies, 1), lambda h, i, *_: (h, i, 0))
    page_buf = pltpu.VMEM((2, pages_per_chunk, *call.k_pool.shape[3:]), call.k_pool.dtype)
    out_rows = (dims.num_kv_heads, num_blocks_q * copies)
    f32 = jnp.float32
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=6,
            grid=(dims.num_kv_heads, num_blocks_q),
            in_specs=[
                tile_spec,
                rows_spec,
                rows_spec,
                rows_spec,
                pl.BlockSpec(memory_space=pl.ANY),
                pl.BlockSpec(memory_space=pl.ANY),
            ],
            out_specs=[tile_spec, stat_spec, stat_spec],
            scratch_shapes=[page_buf, page_buf, pltpu.SemaphoreType.DMA((2, 2))],
        ),
        out_shape=[
            jax.ShapeDtypeStruct((*out_rows, width), f32),
            jax.ShapeDtypeStruct((*out_rows, 1), f32),
            jax.ShapeDtypeStruct((*out_rows, 1), f32),
        ],
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        interpret=pltpu.InterpretParams() if interpret else False,
    )(*operands)
