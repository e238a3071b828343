"""Adversarial ragged batches and the float64 numpy attention every implementation must match.

A case is given as `(q_len, kv_len)` per real sequence. Pools are built in the
canonical layout and handed to each implementation reshaped to its own (`RaggedCase.args`).
Everything an implementation must not
read is NaN: other layers, the sink block, slots past each sequence's kv_len, table entries past
a sequence's pages (they point at the sink), padded sequences' tables and padding query rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np
from jax.extend.core import jaxprs_in_params
from jax.numpy import bfloat16

from jserve.pallas import kv_cache_shape

# Relative error = max |out - ref| / max |ref| over real rows (ref in float64).
TOLERANCE = {np.dtype(np.float32): 1e-5, np.dtype(bfloat16): 2e-2}


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of a case: heads, head_dim, block size, layers and padded buckets."""

    num_q_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    block_size: int = 16
    num_layers: int = 2
    layer: int = 1
    num_tokens: int | None = None  # T bucket; default: real tokens + 3
    max_seqs: int | None = None  # S bucket; default: real sequences + 2
    max_blocks: int | None = None  # table columns; default: enough + 1
    num_blocks: int | None = None  # pool blocks; default: sink + used + 3 never referenced
    dtype: str = "float32"


@dataclasses.dataclass
class RaggedCase:
    """Host arrays of one call (argument order of ragged_paged_attention) and its sequences."""

    q: np.ndarray  # [T, Hq, D]
    k_pool: np.ndarray  # [L, num_blocks, Hkv, block_size, D] (canonical)
    v_pool: np.ndarray
    block_tables: np.ndarray  # [S, max_blocks] int32
    cu_q_lens: np.ndarray  # [S + 1] int32
    kv_lens: np.ndarray  # [S] int32
    num_seqs: np.ndarray  # [1] int32
    layer: np.ndarray  # [] int32
    seqs: list[tuple[int, int]]

    def args(self, impl: str) -> tuple[np.ndarray, ...]:
        """The call's arguments, the pools laid out as `impl` reads them (a row-major
        reshape of the canonical layout, see jserve.pallas.kv_cache)."""
        num_layers, num_blocks, num_kv_heads, block_size, head_dim = self.k_pool.shape
        shape = kv_cache_shape(
            num_layers, num_blocks, block_size, num_kv_heads, head_dim, impl=impl
        )  # fmt: skip
        return (
            self.q, self.k_pool.reshape(shape), self.v_pool.reshape(shape), self.block_tables,
            self.cu_q_lens, self.kv_lens, self.num_seqs, self.layer,
        )  # fmt: skip


BUCKETS = ("num_tokens", "max_seqs", "max_blocks", "num_blocks")


def _pages(seqs: list[tuple[int, int]], bs: int, shared_blocks: int) -> tuple[list, list, list]:
    """Per sequence: pages needed, pages of the shared prefix, pages of its own."""
    needed = [-(-kv // bs) for _, kv in seqs]
    shared = [min(shared_blocks, kv // bs) for _, kv in seqs]
    return needed, shared, [n - c for n, c in zip(needed, shared, strict=True)]


def bucket_sizes(
    seqs: list[tuple[int, int]], geo: Geometry = Geometry(), shared_blocks: int = 0
) -> dict[str, int]:
    """The geometry's buckets for these sequences: each one it leaves unset is the default."""
    needed, shared, own = _pages(seqs, geo.block_size, shared_blocks)
    defaults = {
        "num_tokens": sum(q for q, _ in seqs) + 3,
        "max_seqs": len(seqs) + 2,
        "max_blocks": max(needed, default=0) + 1,
        "num_blocks": 1 + max(shared, default=0) + sum(own) + 3,
    }
    return {name: getattr(geo, name) or default for name, default in defaults.items()}


def build_case(
    seqs: list[tuple[int, int]], geo: Geometry = Geometry(), seed: int = 0, shared_blocks: int = 0
) -> RaggedCase:
    """A batch with the given (q_len, kv_len) sequences, pages scattered over the pool.

    With `shared_blocks`, every sequence's first pages, as many as it fills whole up to that
    number, are the same blocks (a cached prompt prefix), written once."""
    rng = np.random.default_rng(seed)
    dtype = np.dtype(bfloat16) if geo.dtype == "bfloat16" else np.dtype(geo.dtype)
    bs, d = geo.block_size, geo.head_dim
    needed, shared, own = _pages(seqs, bs, shared_blocks)
    sizes = bucket_sizes(seqs, geo, shared_blocks)
    num_tokens, max_seqs, max_blocks, num_blocks = (sizes[name] for name in BUCKETS)
    assert sum(q for q, _ in seqs) <= num_tokens and len(seqs) <= max_seqs
    assert max(needed, default=0) <= max_blocks
    assert num_blocks >= 1 + max(shared, default=0) + sum(own)
    shape = kv_cache_shape(geo.num_layers, num_blocks, bs, geo.num_kv_heads, d, impl="reference")
    k_pool = np.full(shape, np.nan, np.float32)
    v_pool = np.full(shape, np.nan, np.float32)
    free = 1 + rng.permutation(num_blocks - 1)  # never the sink
    tables = np.zeros((max_seqs, max_blocks), np.int32)
    cu = np.zeros(max_seqs + 1, np.int32)
    kv_lens = np.zeros(max_seqs, np.int32)
    q = np.full((num_tokens, geo.num_q_heads, d), np.nan, np.float32)
    prefix, free = free[: max(shared, default=0)], free[max(shared, default=0) :]
    written = set()
    for s, (q_len, kv_len) in enumerate(seqs):
        mine, free = free[: own[s]], free[own[s] :]
        blocks = np.concatenate([prefix[: shared[s]], mine])
        tables[s, : needed[s]] = blocks
        for pos in range(kv_len):
            block, off = blocks[pos // bs], pos % bs
            if (block, off) in written:
                continue  # a shared prefix position, written by an earlier sequence
            written.add((block, off))
            k_pool[geo.layer, block, :, off] = rng.standard_normal((geo.num_kv_heads, d))
            v_pool[geo.layer, block, :, off] = rng.standard_normal((geo.num_kv_heads, d))
        cu[s + 1] = cu[s] + q_len
        kv_lens[s] = kv_len
        q[cu[s] : cu[s + 1]] = rng.standard_normal((q_len, geo.num_q_heads, d))
    n = len(seqs)
    # Padded sequences: garbage lengths prove they are never read; their tables are the sink.
    cu[n + 1 :] = cu[n] + 1_000
    kv_lens[n:] = 1_000_000
    return RaggedCase(
        q.astype(dtype), k_pool.astype(dtype), v_pool.astype(dtype), tables, cu, kv_lens,
        np.array([n], np.int32), np.array(geo.layer, np.int32), list(seqs),
    )  # fmt: skip


def naive_attention(
    case: RaggedCase, sm_scale: float, sliding_window: int | None, soft_cap: float | None
) -> np.ndarray:
    """Float64 attention reading only each sequence's live positions; padding rows are 0."""
    q = case.q.astype(np.float64)
    num_tokens, num_q_heads, d = q.shape
    out = np.zeros((num_tokens, num_q_heads, d))
    layer = int(case.layer)
    _, _, num_kv_heads, bs, _ = case.k_pool.shape
    group = num_q_heads // num_kv_heads
    for s, (q_len, kv_len) in enumerate(case.seqs):
        pages = case.block_tables[s, : -(-kv_len // bs)]
        k = case.k_pool[layer, pages].astype(np.float64)  # [pages, Hkv, bs, D]
        v = case.v_pool[layer, pages].astype(np.float64)
        k = k.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, d)[:, :kv_len]
        v = v.transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, d)[:, :kv_len]
        k, v = np.repeat(k, group, axis=0), np.repeat(v, group, axis=0)  # [Hq, kv_len, D]
        start = case.cu_q_lens[s]
        for i in range(q_len):
            ctx = kv_len - q_len + i
            lo = 0 if sliding_window is None else max(0, ctx - sliding_window + 1)
            scores = np.einsum("hd,hkd->hk", q[start + i], k[:, lo : ctx + 1]) * sm_scale
            if soft_cap is not None:
                scores = soft_cap * np.tanh(scores / soft_cap)
            p = np.exp(scores - scores.max(axis=-1, keepdims=True))
            p /= p.sum(axis=-1, keepdims=True)
            out[start + i] = np.einsum("hk,hkd->hd", p, v[:, lo : ctx + 1])
    return out


def relative_error(case: RaggedCase, out: np.ndarray, ref: np.ndarray) -> float:
    """max |out - ref| / max |ref| over the real rows."""
    real = int(case.cu_q_lens[int(case.num_seqs[0])])
    if real == 0:
        return 0.0
    out = np.asarray(out, np.float64)[:real]
    return float(np.max(np.abs(out - ref[:real])) / max(np.max(np.abs(ref[:real])), 1e-30))


def padding_rows(case: RaggedCase, out: np.ndarray) -> np.ndarray:
    """The outputs of padded tokens (past cu_q_lens[num_seqs]), which must be exactly 0."""
    return np.asarray(out, np.float32)[int(case.cu_q_lens[int(case.num_seqs[0])]) :]


def run_impl(impl: str, case: RaggedCase, **options) -> np.ndarray:
    """Output of one implementation on a case: the dispatcher runs a kernel natively on its
    backend (Triton under JAX_PLATFORMS=cuda on a GPU, bench/gpu_check.sh) and interprets it
    elsewhere."""
    import jax.numpy as jnp

    from jserve.pallas import ragged_paged_attention

    args = [jnp.asarray(a) for a in case.args(impl)]
    return np.asarray(ragged_paged_attention(*args, impl=impl, **options))


def assert_matches_naive(impl: str, case: RaggedCase, **options) -> float:
    """Run `impl` and check it against the float64 naive attention; returns the error."""
    sm_scale = case.q.shape[-1] ** -0.5
    out = run_impl(impl, case, sm_scale=sm_scale, **options)
    ref = naive_attention(case, sm_scale, options.get("sliding_window"), options.get("soft_cap"))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    assert not np.isnan(out.astype(np.float32)).any(), f"{impl}: NaN in the output"
    err = relative_error(case, out, ref)
    tol = TOLERANCE[case.q.dtype]
    assert err <= tol, f"{impl}: relative error {err:.2e} > {tol:.0e} for {case.seqs}"
    pad = padding_rows(case, out)
    assert np.all(pad == 0), f"{impl}: padding rows are not exactly 0 (max {np.abs(pad).max()})"
    return err


def quantized_case(case: RaggedCase, dtype: np.dtype = np.int8) -> tuple[tuple, RaggedCase]:
    """(`case`'s pools quantized to `dtype` (int8 or a float8) with their scales, the case with
    those pools dequantized in float64): slots nobody may read (NaN in the float case) get
    garbage (int8 -99, float8 NaN) and a NaN scale."""
    import jax.numpy as jnp

    from jserve.pallas.kv_cache import quantize_kv

    dtype = np.dtype(dtype)
    garbage = np.array(-99 if dtype == np.int8 else np.nan, dtype)
    parts = []
    for pool in (case.k_pool, case.v_pool):
        live = ~np.isnan(pool).any(axis=-1)
        q, scale = (np.asarray(a) for a in quantize_kv(jnp.asarray(np.nan_to_num(pool)), dtype))
        q = np.where(live[..., None], q, garbage)
        parts.append((q, np.where(live, scale, np.float32(np.nan))))
    (kq, ks), (vq, vs) = parts
    dequant = dataclasses.replace(
        case,
        k_pool=kq.astype(np.float64) * ks[..., None].astype(np.float64),
        v_pool=vq.astype(np.float64) * vs[..., None].astype(np.float64),
    )
    return (kq, vq, ks, vs), dequant


# Quantized pools' attention cases (tests/pallas/test_kv_int8.py, test_kv_fp8.py): (sequences
# as (query length, context), geometry, options).
QUANTIZED_POOL_CASES = {
    "decode_and_prefill": ([(1, 17), (1, 33), (12, 47), (30, 95)], Geometry(), {}),
    "window_and_cap": (
        [(1, 100), (40, 70), (1, 9)],
        Geometry(),
        dict(sliding_window=24, soft_cap=8.0),
    ),
    "gqa8_d128_b32": (
        [(1, 48), (20, 20), (5, 70)],
        Geometry(num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=32),
        {},
    ),
}


def traced_equations(jaxpr, primitive: str) -> list:
    """Every equation of `primitive` (e.g. "dot_general", "pallas_call") in a traced program,
    the jaxprs nested in it (kernels, loop bodies) included: what a program asks of a backend,
    read where the CPU cannot show it (precision, bounds)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == primitive:
            found.append(eqn)
        for sub in jaxprs_in_params(eqn.params):
            found += traced_equations(sub, primitive)
    return found
