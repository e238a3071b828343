"""The one public ragged paged attention entry: picks an implementation by backend and dtype.

cpu -> ragged_native (a native C++ kernel, decode and prefill rows alike) for float32 where the
kernel builds, else the plain-XLA loops of ragged_xla (Pallas only interprets on CPU; the
interpret kernel stays for checking the kernel's semantics in tests). gpu -> the Triton kernel,
tpu -> the Mosaic kernel; any other backend -> the jnp reference. Quantized pools (int8 and
float8, with their scales, kv_cache) are read by the Triton kernel on GPU and by ragged_xla on
TPU (the Mosaic kernel does not read them yet); on CPU ragged_native reads int8 and ragged_xla
float8.
bench.kernel_timings times them side by side.
"""

from __future__ import annotations

from enum import StrEnum

import jax
import jax.numpy as jnp

from jserve.config.engine_args import AttentionImpl, KVCacheDtype
from jserve.pallas.kv_cache import kv_cache_dtype_of
from jserve.pallas.ragged_common import RaggedCall, quantized_kv_impls
from jserve.pallas.ragged_interpret import ragged_paged_attention_interpret
from jserve.pallas.ragged_mosaic import ragged_paged_attention_mosaic
from jserve.pallas.ragged_native import native_supports, ragged_paged_attention_native
from jserve.pallas.ragged_reference import ragged_paged_attention_reference
from jserve.pallas.ragged_triton import ragged_paged_attention_triton
from jserve.pallas.ragged_xla import ragged_paged_attention_xla


class _Interpret(StrEnum):
    """How an implementation takes `interpret`."""

    NEVER = "never"  # plain XLA or a native kernel: no interpret mode
    ALWAYS = "always"  # the CPU interpret kernel
    OFF_ITS_BACKENDS = "off_its_backends"  # native on its backends, interpreted elsewhere


# implementation -> (its function, how it takes `interpret`, the backends it runs natively on)
_IMPL_TABLE = {
    AttentionImpl.REFERENCE: (ragged_paged_attention_reference, _Interpret.NEVER, ()),
    AttentionImpl.INTERPRET: (ragged_paged_attention_interpret, _Interpret.ALWAYS, ()),
    AttentionImpl.XLA: (ragged_paged_attention_xla, _Interpret.NEVER, ()),
    AttentionImpl.NATIVE: (ragged_paged_attention_native, _Interpret.NEVER, ()),
    AttentionImpl.TRITON: (
        ragged_paged_attention_triton,
        _Interpret.OFF_ITS_BACKENDS,
        ("gpu", "cuda"),
    ),
    AttentionImpl.MOSAIC: (ragged_paged_attention_mosaic, _Interpret.OFF_ITS_BACKENDS, ("tpu",)),
}
IMPLS = tuple(_IMPL_TABLE)  # every implementation AUTO may stand for, and those it never picks
_BY_BACKEND = {
    "cpu": AttentionImpl.NATIVE,
    "gpu": AttentionImpl.TRITON,
    "cuda": AttentionImpl.TRITON,
    "tpu": AttentionImpl.MOSAIC,
}


def choose_impl(
    backend: str | None = None,
    dtype: jnp.dtype = jnp.float32,
    kv_cache_dtype: str = KVCacheDtype.AUTO,
) -> AttentionImpl:
    """The implementation AUTO means on `backend` (default: jax.default_backend()) for queries
    of `dtype` and pools of `kv_cache_dtype`: on CPU the native kernel where it supports the
    dtype and builds, else XLA; Triton on GPU, Mosaic on TPU, the reference elsewhere; for
    quantized pools XLA wherever the chosen one does not read them (quantized_kv_impls)."""
    chosen = _BY_BACKEND.get(backend or jax.default_backend(), AttentionImpl.REFERENCE)
    if chosen is AttentionImpl.NATIVE and not native_supports(dtype):
        return AttentionImpl.XLA
    if kv_cache_dtype != KVCacheDtype.AUTO and chosen not in quantized_kv_impls(kv_cache_dtype):
        return AttentionImpl.XLA
    return chosen


def ragged_paged_attention(
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
    impl: AttentionImpl | str = AttentionImpl.AUTO,
    interpret: bool | None = None,
    platform: str | None = None,
    kv_scales: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """Attention of a ragged batch of queries over a paged KV pool, for one layer.

    Sequence `s` owns query rows `cu_q_lens[s]:cu_q_lens[s + 1]` (its q_len) and has
    `kv_lens[s]` cached positions, this step's tokens included (write them with `write_kv`
    first). Its query `i` attends to positions `p <= kv_lens[s] - q_len + i` (and
    `p > kv_lens[s] - q_len + i - sliding_window` with a window). Only sequences
    `< num_seqs` are read; tokens at or past `cu_q_lens[num_seqs]` are padding and their
    outputs are exactly 0. Block tables are only read for a sequence's first
    `ceil(kv_lens[s] / block_size)` entries plus, for whole-chunk reads, entries after them,
    which must point at the sink block 0 (as must padded sequences' rows).

    Args:
      q: [T, Hq, D] queries of all scheduled tokens, T padded to a bucket.
      k_pool, v_pool: keys and values of all layers in `kv_cache_shape`'s layout for the
        implementation ([L, num_blocks, Hkv, block_size, D] but for Mosaic, head_dim < 128).
      block_tables: [S, max_blocks] int32 pool block of each sequence's i-th block; S padded.
      cu_q_lens: [S + 1] int32 cumulative query lengths; only [:num_seqs + 1] is read.
      kv_lens: [S] int32 context length of each sequence including this step's tokens.
      num_seqs: [] or [1] int32 number of real sequences.
      layer: [] int32 (may be traced) layer of the pools to read.
      sm_scale: softmax scale applied to q, e.g. head_dim ** -0.5.
      sliding_window: None, or the number of most recent positions each query may see.
      soft_cap: None, or c for scores -> c * tanh(scores / c).
      impl: an AttentionImpl (or its name); AUTO picks by `platform` (`choose_impl`).
      interpret: for "triton" / "mosaic": None runs natively on their backend, else interprets;
        True forces the interpreter ("interpret" always interprets; the others take None only).
      platform: the platform the call is compiled for, which AUTO and `interpret=None`
        follow (default: jax.default_backend(); jserve.aot names a chip this process lacks).
      kv_scales: an int8 or float8 pool's (k_scales, v_scales) (kv_scales_shape), else None.
    Returns [T, Hq, D] attention outputs in q's dtype.
    """
    platform = platform or jax.default_backend()
    kv_dtype = KVCacheDtype.AUTO if kv_scales is None else kv_cache_dtype_of(k_pool.dtype)
    chosen = impl if impl != AttentionImpl.AUTO else choose_impl(platform, q.dtype, kv_dtype)
    if chosen not in _IMPL_TABLE:
        raise ValueError(f"impl must be 'auto' or one of {tuple(map(str, IMPLS))}; got {impl!r}")
    call = RaggedCall.make(
        q, k_pool, v_pool, block_tables, cu_q_lens, kv_lens, num_seqs, layer,
        sm_scale=sm_scale, sliding_window=sliding_window, soft_cap=soft_cap, impl=chosen,
        kv_scales=kv_scales,
    )  # fmt: skip
    return _run(AttentionImpl(chosen), call, interpret, platform)


def _run(
    chosen: AttentionImpl, call: RaggedCall, interpret: bool | None, platform: str
) -> jax.Array:
    """`call` run by implementation `chosen`, natively or interpreted as `interpret` asks
    (see ragged_paged_attention), compiled for `platform`."""
    fn, mode, backends = _IMPL_TABLE[chosen]
    if mode is _Interpret.NEVER:
        if interpret is not None:
            raise ValueError(f"impl='{chosen}' has no interpret mode; got interpret={interpret}")
        return fn(call)
    if mode is _Interpret.ALWAYS:
        if interpret is False:
            raise ValueError(f"impl='{chosen}' only runs in interpret mode; got interpret=False")
        return fn(call)
    if interpret is None:
        interpret = platform not in backends
    return fn(call, interpret=interpret)
