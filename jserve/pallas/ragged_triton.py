"""Ragged paged attention as a Pallas kernel lowered to Triton (CUDA GPUs).

Grid `(work item, KV head, KV split)`: a work item is one `block_q`-token query block of one
sequence (items are numbered in the wrapper from cu_q_lens, so decode rows and prefill chunks
share one launch), and KV splits divide the item's KV range so decode at long context still
fills the GPU (flash-decoding); a small jnp epilogue merges the splits' partial softmaxes.
Each program serves the `group` query heads of one KV head at once: rows are (token, head)
pairs, the head group padded to a power of two, because Triton tiles are powers of two and
`tl.dot` needs at least 16 rows. K/V rows are gathered straight from the paged pool through the
block table (`pool[layer, page, head, offset, :]`, each row contiguous); V rows past kv_len are
masked loads that read nothing. A quantized pool (int8 or float8, with a float32 scale per token
and KV head) is dequantized as its rows are gathered, into q's dtype, its V rows past kv_len
read and then zeroed. Partial results are masked stores, so a block's rows past its sequence's
end never clobber the next sequence's rows.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

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

# Untuned: 32-row query tiles, 64-token KV chunks, 8 KV splits have not been timed on a GPU yet
# (bench/RESULTS.md, "Kernels", says what has run where; `python -m bench.kernel_timings` on a CUDA
# machine times them against a device-to-device copy).
DEFAULT_ROWS = 32
DEFAULT_CHUNK_TOKENS = 64
DEFAULT_NUM_KV_SPLITS = 8


def _next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def validate_triton_config(
    dims: RaggedDims, block_q: int, pages_per_chunk: int, num_kv_splits: int
) -> None:
    """Static checks of Triton's tile rules (powers of two, dot sizes >= 16); raises ValueError."""
    rows = block_q * _next_pow2(dims.group_size)
    chunk = pages_per_chunk * dims.block_size
    for name, value in (("block_q", block_q), ("pages_per_chunk", pages_per_chunk)):
        if not isinstance(value, int) or not _is_pow2(value):
            raise ValueError(f"{name} must be a power of two; got {value!r}")
    check_tile_options(num_kv_splits=num_kv_splits)
    checks = {
        "head_dim": dims.head_dim,
        "block_q * next_pow2(group_size)": rows,
        "pages_per_chunk * block_size": chunk,
    }
    bad = {name: v for name, v in checks.items() if not (_is_pow2(v) and v >= 16)}
    if bad:
        raise ValueError(
            f"the Triton kernel needs powers of two >= 16 for {bad} (tile sizes and tl.dot); "
            "choose block_q / pages_per_chunk accordingly or use impl='reference'"
        )


def default_triton_config(dims: RaggedDims) -> tuple[int, int]:
    """(block_q, pages_per_chunk) giving DEFAULT_ROWS rows and DEFAULT_CHUNK_TOKENS tokens."""
    block_q = max(1, DEFAULT_ROWS // _next_pow2(dims.group_size))
    return block_q, max(1, DEFAULT_CHUNK_TOKENS // dims.block_size)


class _Options(NamedTuple):
    """The kernel's static options (see ragged_paged_attention_triton)."""

    dims: RaggedDims
    block_q: int
    group_pad: int  # the head group padded to a power of two
    pages_per_chunk: int
    num_kv_splits: int
    sm_scale: float
    sliding_window: int | None
    soft_cap: float | None


def _kernel(
    item_seq_ref,  # [items] sequence of each work item, max_seqs when unused
    item_q0_ref,  # [items] first query row of the item within its sequence
    cu_q_lens_ref,  # [S + 1]
    kv_lens_ref,  # [S]
    tables_ref,  # [S, max_blocks]
    layer_ref,  # [1]
    q_ref,  # [Hkv, (T + block_q) * group_pad, D], row = token * group_pad + head in group
    k_ref,  # [L, num_blocks, Hkv, block_size, D]
    v_ref,  # [L, num_blocks, Hkv, block_size, D]
    *refs,  # a quantized pool's k and v scales [L, num_blocks, Hkv, block_size], then outputs:
    # acc [splits, Hkv, rows_total, D] unnormalized partial outputs, max and denom
    # [splits, Hkv, rows_total] running max and softmax denominator
    opts: _Options,
):
    *scale_refs, acc_ref, max_ref, denom_ref = refs
    item, head, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    seq = item_seq_ref[item]
    dims, group_pad = opts.dims, opts.group_pad
    rows, bs = opts.block_q * group_pad, dims.block_size
    chunk = opts.pages_per_chunk * bs

    @pl.when(seq < dims.max_seqs)
    def _():
        q_start = cu_q_lens_ref[seq]
        q_len, kv_len = cu_q_lens_ref[seq + 1] - q_start, kv_lens_ref[seq]
        q0, layer = item_q0_ref[item], layer_ref[0]
        row0 = (q_start + q0) * group_pad
        # Scaled in float32, then back to q's dtype (a float pool's): bf16 uses bf16 dots.
        q = q_ref[head, pl.ds(row0, rows), :]  # [rows, D]
        q = (q.astype(jnp.float32) * opts.sm_scale).astype(q_ref.dtype)
        token = q0 + lax.broadcasted_iota(jnp.int32, (rows, 1), 0) // group_pad
        row_ctx = kv_len - q_len + token  # [rows, 1]
        s_lo, s_hi = _split_chunks(kv_len - q_len + q0, kv_len, split, opts)
        dim = lax.broadcasted_iota(jnp.int32, (1, dims.head_dim), 1)

        def chunk_step(c, carry):
            pos = c * chunk + lax.broadcasted_iota(jnp.int32, (chunk, 1), 0)  # [C, 1]
            page = tables_ref[seq, pos // bs]  # [C, 1]
            at = (layer, page, head, pos % bs, dim)  # gathers [C, D]
            live = jnp.broadcast_to(pos < kv_len, (chunk, dims.head_dim))
            k, v = _gather_kv(k_ref, v_ref, scale_refs, at, live, q.dtype)
            scores = cap_scores(qk(q, k), opts.soft_cap)  # [rows, C] float32
            mask = allowed(pos.reshape(1, chunk), row_ctx, kv_len, opts.sliding_window)
            return online_softmax_step(carry, scores, mask, v)

        init = online_softmax_init((rows,), dims.head_dim)
        partial = lax.fori_loop(s_lo, s_hi, chunk_step, init)
        mine = token < q_len  # rows past the sequence's end belong to the next one
        outs = (acc_ref, max_ref, denom_ref)
        _store_partial(outs, (split, head, pl.ds(row0, rows)), mine, partial, dims.head_dim)


def _gather_kv(
    k_ref, v_ref, scale_refs: list, at: tuple, live: jax.Array, dtype: jnp.dtype
) -> tuple[jax.Array, jax.Array]:
    """K and V rows [C, D] at `at` = (layer, pages, head, offsets, dims), V's rows past kv_len
    (not `live`) zero. A quantized pool's rows (`scale_refs` = its k and v scales) are times
    their token's scale, in `dtype` (q's)."""
    k = k_ref[at]
    if not scale_refs:
        return k, plgpu.load(v_ref.at[at], mask=live, other=0.0)
    ks_ref, vs_ref = scale_refs
    rows_at = at[:4]  # gathers [C, 1]
    k = (k.astype(jnp.float32) * ks_ref[rows_at]).astype(dtype)
    # Read where K was (no masked load: Triton cannot fill float8 with a constant), rows past
    # kv_len zeroed after the scale, NaN in a stale slot included.
    v = v_ref[at].astype(jnp.float32) * vs_ref[rows_at]
    return k, jnp.where(live, v, 0.0).astype(dtype)


def _split_chunks(
    first_ctx: jax.Array, kv_len: jax.Array, split: jax.Array, opts: _Options
) -> tuple[jax.Array, jax.Array]:
    """[lo, hi) of the KV chunks split `split` reads for a query block whose first row sees up
    to position `first_ctx`: the block's KV range (from the first position its sliding window
    shows to the last position its last row sees) in chunks of `pages_per_chunk` pages, cut
    into `num_kv_splits` near-equal parts, the last ones possibly empty."""
    chunk = opts.pages_per_chunk * opts.dims.block_size
    last_ctx = jnp.minimum(first_ctx + opts.block_q, kv_len) - 1
    window = opts.sliding_window
    lo = 0 if window is None else jnp.maximum(first_ctx - window + 1, 0)
    c_lo, c_hi = lo // chunk, last_ctx // chunk + 1
    per_split = pl.cdiv(c_hi - c_lo, opts.num_kv_splits)
    s_lo = c_lo + split * per_split
    return s_lo, jnp.minimum(s_lo + per_split, c_hi)


def _store_partial(outs: tuple, at: tuple, mine: jax.Array, partial: tuple, head_dim: int) -> None:
    """Store one program's partial softmax (running max, denominator, unnormalized output) at
    `at` = (split, KV head, rows) of the outputs `outs` = (acc, max, denom), masked to the rows
    that are `mine` ([rows, 1])."""
    acc_ref, max_ref, denom_ref = outs
    split, head, out_rows = at
    m, denom, acc = partial
    rows = acc.shape[0]
    plgpu.store(
        acc_ref.at[split, head, out_rows, :], acc, mask=jnp.broadcast_to(mine, (rows, head_dim))
    )
    plgpu.store(max_ref.at[split, head, out_rows], m.reshape(rows), mask=mine.reshape(rows))
    plgpu.store(denom_ref.at[split, head, out_rows], denom.reshape(rows), mask=mine.reshape(rows))


def _work_items(
    cu_q_lens: jax.Array, num_seqs: jax.Array, block_q: int, num_items: int
) -> tuple[jax.Array, jax.Array]:
    """(sequence, first query row) of each query block; unused items get sequence S."""
    max_seqs = cu_q_lens.shape[0] - 1
    real = jnp.arange(max_seqs) < num_seqs.reshape(())
    blocks = jnp.where(real, pl.cdiv(cu_q_lens[1:] - cu_q_lens[:-1], block_q), 0)
    ends = jnp.cumsum(blocks)
    items = jnp.arange(num_items, dtype=jnp.int32)
    seq = jnp.searchsorted(ends, items, side="right").astype(jnp.int32)
    first_item = ends[jnp.minimum(seq, max_seqs - 1)] - blocks[jnp.minimum(seq, max_seqs - 1)]
    return seq, ((items - first_item) * block_q).astype(jnp.int32)


@functools.partial(
    jax.jit, static_argnames=("block_q", "pages_per_chunk", "num_kv_splits", "interpret")
)
def ragged_paged_attention_triton(
    call: RaggedCall,
    *,
    block_q: int | None = None,
    pages_per_chunk: int | None = None,
    num_kv_splits: int = DEFAULT_NUM_KV_SPLITS,
    interpret: bool = False,
) -> jax.Array:
    """Ragged paged attention by the Triton kernel (interpret=True runs it on CPU); see
    `ragged_paged_attention` for the call. Padded tokens' outputs are exactly 0."""
    default_block_q, default_pages = default_triton_config(call.dims)
    block_q = block_q or default_block_q
    pages_per_chunk = pages_per_chunk or default_pages
    validate_triton_config(call.dims, block_q, pages_per_chunk, num_kv_splits)
    group_pad = _next_pow2(call.dims.group_size)
    qt = _by_kv_head(call.q, call.dims, block_q, group_pad)
    rows_total = qt.shape[1]
    num_items = pl.cdiv(call.dims.num_tokens, block_q) + call.dims.max_seqs
    item_seq, item_q0 = _work_items(call.cu_q_lens, call.num_seqs, block_q, num_items)
    opts = _Options(
        call.dims, block_q, group_pad, pages_per_chunk, num_kv_splits, call.sm_scale,
        call.sliding_window, call.soft_cap,
    )  # fmt: skip
    hkv, d, f32 = call.dims.num_kv_heads, call.dims.head_dim, jnp.float32
    partials = pl.pallas_call(
        functools.partial(_kernel, opts=opts),
        grid=(num_items, hkv, num_kv_splits),
        out_shape=(
            jax.ShapeDtypeStruct((num_kv_splits, hkv, rows_total, d), f32),
            jax.ShapeDtypeStruct((num_kv_splits, hkv, rows_total), f32),
            jax.ShapeDtypeStruct((num_kv_splits, hkv, rows_total), f32),
        ),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret,
    )(
        item_seq,
        item_q0,
        call.cu_q_lens,
        call.kv_lens,
        # A chunk reads whole pages of table entries: columns up to a whole chunk past the
        # last page, which must exist (Triton's loads have no bounds; one past the table's
        # end faults on the device).
        pad_table_columns(call.block_tables, pages_per_chunk),
        call.layer.reshape(1),
        qt,
        call.k_pool,
        call.v_pool,
        *(call.kv_scales or ()),
    )
    return _merge_splits(*partials, call, block_q, group_pad)


def _by_kv_head(q: jax.Array, dims: RaggedDims, block_q: int, group_pad: int) -> jax.Array:
    """Queries [T, Hq, D] laid out as the kernel reads them: [Hkv, (T + block_q) * group_pad,
    D], row = token * group_pad + head in its group; pad heads and rows are zeros."""
    num_tokens, hkv, group, d = dims.num_tokens, dims.num_kv_heads, dims.group_size, dims.head_dim
    qt = q.reshape(num_tokens, hkv, group, d)
    qt = jnp.pad(qt, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    return qt.transpose(1, 0, 2, 3).reshape(hkv, -1, d)


def _merge_splits(
    acc: jax.Array, m: jax.Array, denom: jax.Array, call: RaggedCall, block_q: int, group_pad: int
) -> jax.Array:
    """The outputs [T, Hq, D] from the KV splits' partial softmaxes (an empty split has
    m = MASK_VALUE: weight 0). Rows no program wrote (padding tokens, pad heads) hold garbage
    and are dropped here; padding tokens' outputs are exactly 0."""
    num_tokens, hkv, group, d = (
        call.dims.num_tokens, call.dims.num_kv_heads, call.dims.group_size, call.dims.head_dim,
    )  # fmt: skip
    weight = jnp.exp(m - m.max(axis=0, keepdims=True))[..., None]
    out = online_softmax_finish((weight * denom[..., None]).sum(0), (weight * acc).sum(0))
    out = out.reshape(hkv, num_tokens + block_q, group_pad, d)[:, :num_tokens, :group]
    out = out.transpose(1, 0, 2, 3).reshape(num_tokens, hkv * group, d)
    real = jnp.arange(num_tokens) < call.cu_q_lens[call.num_seqs.reshape(())]
    return jnp.where(real[:, None, None], out, 0.0).astype(call.q.dtype)
