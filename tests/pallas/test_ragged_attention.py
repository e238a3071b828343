"""Every ragged paged attention implementation against float64 numpy attention on CPU.

Named adversarial cases, then hypothesis-generated ragged batches (tests/budgets.py: the
`thorough` budgets behind @pytest.mark.slow). The native kernel runs at every ISA level this
machine can run (tests/pallas/native_levels.py). Kernels for GPU and TPU run in interpret
mode; the TPU interpreter costs about a second per call, so it gets a few named cases in CI
and the rest under `slow`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.pallas.native_isa import ISA_ENV
from tests.budgets import THOROUGH, examples
from tests.pallas.native_levels import NATIVE, runnable_levels
from tests.pallas.ragged_cases import (
    BUCKETS,
    Geometry,
    assert_matches_naive,
    bucket_sizes,
    build_case,
    traced_equations,
)

SMOLLM = Geometry()  # 9 query heads, 3 KV heads, head_dim 64, block 16, float32
GQA1_D128_B32 = Geometry(num_q_heads=4, num_kv_heads=4, head_dim=128, block_size=32)
GQA8_D128 = Geometry(num_q_heads=8, num_kv_heads=1, head_dim=128)
GQA3_D64_B32 = Geometry(num_q_heads=6, num_kv_heads=2, block_size=32)

# name -> (seqs as (q_len, kv_len), geometry, options)
NAMED = {
    "decode_block_edges": ([(1, 17), (1, 16), (1, 15), (1, 1), (1, 33), (1, 32)], SMOLLM, {}),
    "prefill_block_edges": ([(16, 16), (17, 17), (1, 1), (40, 40)], SMOLLM, {}),
    "mixed_chunks": ([(1, 100), (12, 47), (1, 64), (30, 95)], SMOLLM, {}),
    "single_token": ([(1, 1)], SMOLLM, {}),
    "gqa1_d128_b32": ([(1, 31), (9, 64), (33, 65)], GQA1_D128_B32, {}),
    "gqa8_d128": ([(1, 48), (20, 20), (5, 70)], GQA8_D128, {}),
    "gqa3_b32": ([(3, 33), (1, 95)], GQA3_D64_B32, {}),
    "window_and_cap": ([(1, 100), (40, 70), (1, 9)], SMOLLM, dict(sliding_window=24, soft_cap=8.0)),
    "window_only": ([(5, 64), (1, 33)], GQA3_D64_B32, dict(sliding_window=17)),
    "bf16_mixed": ([(1, 100), (12, 47), (33, 33)], Geometry(dtype="bfloat16"), {}),
    "layer0_of_3": ([(1, 20), (6, 6)], Geometry(num_layers=3, layer=0), {}),
    "no_real_sequences": ([], Geometry(num_tokens=8, max_seqs=4, max_blocks=2), {}),
    "big_buckets": ([(1, 5), (2, 9)], Geometry(num_tokens=40, max_seqs=9, max_blocks=12), {}),
    # Sequences whose first pages are the same blocks (a cached prompt prefix): the native
    # kernel reads those once for a group of decode rows. 12 decodes make a group of 8 and
    # one of 4; one stops exactly at the prefix's end, one inside it, one chunk follows it.
    "shared_prefix_decode": (
        [(1, 96 + 7 * i) for i in range(10)] + [(1, 96), (1, 40)],
        SMOLLM,
        dict(shared_blocks=6),
    ),
    "shared_prefix_mixed": (
        [(1, 130), (20, 116), (1, 97), (1, 161), (33, 140), (1, 112)],
        GQA8_D128,
        dict(shared_blocks=5),
    ),
    "shared_prefix_window_cap": (
        [(1, 100), (1, 120), (5, 90), (1, 70)],
        SMOLLM,
        dict(shared_blocks=4, sliding_window=24, soft_cap=8.0),
    ),
}
LONG = {
    "long_decode_4096": ([(1, 4096), (1, 4081), (1, 4095)], SMOLLM, {}),
    "long_prefill_chunk_4096": ([(48, 4096), (1, 2049)], SMOLLM, {}),
    "long_gqa8_d128_4096": ([(1, 4096), (7, 4000)], GQA8_D128, {}),
}


def shared_buckets(table: dict) -> dict:
    """`table` with each case's buckets raised to the largest that any case of the same heads,
    dtype, layers and masking needs or sets: one compile of an implementation then serves the
    whole group, where build_case's defaults give every case shapes of its own. Padding stays
    padding (rows, sequences, table columns and pool blocks nothing may read), and a case that
    sets big buckets (all padding, or nearly) keeps buckets at least that big."""

    def group(name: str) -> tuple:
        _, geometry, options = table[name]
        heads = dataclasses.replace(geometry, **dict.fromkeys(BUCKETS))
        return heads, options.get("sliding_window"), options.get("soft_cap")

    sizes = {
        name: bucket_sizes(seqs, geometry, options.get("shared_blocks", 0))
        for name, (seqs, geometry, options) in table.items()
    }
    largest = {
        key: {b: max(sizes[n][b] for n in table if group(n) == key) for b in BUCKETS}
        for key in map(group, table)
    }
    return {
        name: (seqs, dataclasses.replace(geometry, **largest[group(name)]), options)
        for name, (seqs, geometry, options) in table.items()
    }


NAMED, LONG = shared_buckets(NAMED), shared_buckets(LONG)
MOSAIC_CI = ("decode_block_edges", "mixed_chunks", "window_and_cap", "bf16_mixed")
TRITON_LONG_CI = ("long_decode_4096",)


def _check(impl: str, name: str, table: dict) -> None:
    seqs, geometry, options = table[name]
    options = dict(options)
    case = build_case(seqs, geometry, seed=len(name), shared_blocks=options.pop("shared_blocks", 0))
    assert_matches_naive(impl, case, **options)


@pytest.mark.parametrize("name", sorted(NAMED))
@pytest.mark.parametrize("impl", ["reference", "interpret", "xla", *NATIVE, "triton"])
def test_named_case(impl, name):
    if impl == "native" and NAMED[name][1].dtype != "float32":
        pytest.skip("the native kernel is float32 only (the dispatcher uses xla for others)")
    _check(impl, name, NAMED)


@pytest.mark.parametrize("name", sorted(LONG))
@pytest.mark.parametrize("impl", ["reference", "interpret", "xla", *NATIVE])
def test_long_context(impl, name):
    _check(impl, name, LONG)


@pytest.mark.parametrize("name", TRITON_LONG_CI)
def test_triton_long_context(name):
    _check("triton", name, LONG)


@pytest.mark.parametrize("max_blocks", [26, 27, 29])
def test_triton_table_is_whole_chunks_wide(max_blocks):
    """A Triton program reads its sequence's table a whole chunk of pages at a time, up to a
    chunk past its last page, and Triton's loads have no bounds: on an H200 a table of 26
    columns (a 416-token context, 4 pages a chunk) made the device fault with an illegal
    address. The interpreter clamps such reads, so this checks the table the kernel is given:
    a whole number of chunks wide, for widths that are not."""
    from jserve.pallas import ragged_paged_attention
    from jserve.pallas.ragged_triton import DEFAULT_CHUNK_TOKENS

    geo = dataclasses.replace(SMOLLM, max_blocks=max_blocks)
    case = build_case([(1, 16 * 26 - 3), (5, 40)], geo)
    args = [jnp.asarray(a) for a in case.args("triton")]
    traced = jax.make_jaxpr(
        lambda *a: ragged_paged_attention(*a, sm_scale=0.125, impl="triton", interpret=True)
    )(*args)
    kernels = traced_equations(traced.jaxpr, "pallas_call")
    tables = [var.aval for eqn in kernels for var in eqn.invars if var.aval.ndim == 2]
    assert [aval.shape[1] % (DEFAULT_CHUNK_TOKENS // geo.block_size) for aval in tables] == [0]
    assert tables[0].shape[1] >= max_blocks


@pytest.mark.parametrize("name", MOSAIC_CI)
def test_mosaic_named_case(name):
    _check("mosaic", name, NAMED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(NAMED) - set(MOSAIC_CI)))
def test_mosaic_named_case_slow(name):
    """The TPU interpreter's other named cases: test_mosaic_named_case runs four of them, and
    test_named_case every case on the other implementations, by default."""
    _check("mosaic", name, NAMED)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LONG))
@pytest.mark.parametrize("impl", ["triton", "mosaic"])
def test_kernel_long_context_slow(impl, name):
    """The GPU and TPU kernels interpreted at 4096 positions: test_triton_long_context runs one
    case of Triton's, and test_long_context every case on the CPU implementations, by
    default."""
    _check(impl, name, LONG)


# Hypothesis: fixed buckets per geometry, so examples reuse compiled executables. Each pool
# holds max_seqs full block tables, so any drawn batch fits: 1 + max_seqs * max_blocks + 3.
GEOMETRIES = [
    Geometry(num_tokens=64, max_seqs=8, max_blocks=22, num_blocks=180),
    Geometry(num_q_heads=4, num_kv_heads=4, head_dim=128, block_size=32,
             num_tokens=64, max_seqs=8, max_blocks=11, num_blocks=92),
    Geometry(num_q_heads=8, num_kv_heads=1, head_dim=128,
             num_tokens=64, max_seqs=8, max_blocks=22, num_blocks=180),
    Geometry(num_q_heads=6, num_kv_heads=2, block_size=32, dtype="bfloat16",
             num_tokens=64, max_seqs=8, max_blocks=11, num_blocks=92),
]  # fmt: skip
OPTIONS = [{}, dict(sliding_window=37, soft_cap=30.0)]
MAX_CONTEXT = 320


@st.composite
def ragged_batches(draw):
    """(seqs, geometry, options): decode-only, prefill-only or mixed, lengths near blocks."""
    geometry = draw(st.sampled_from(GEOMETRIES))
    bs = geometry.block_size
    kind = draw(st.sampled_from(["decode", "prefill", "mixed"]))
    near_block = st.builds(
        lambda k, d: min(max(k * bs + d, 1), MAX_CONTEXT),
        st.integers(0, MAX_CONTEXT // bs),
        st.sampled_from([-1, 0, 1]),
    )
    kv_len = st.one_of(near_block, st.integers(1, MAX_CONTEXT))
    seqs, tokens = [], 0
    for _ in range(draw(st.integers(1, geometry.max_seqs))):
        kv = draw(kv_len)
        is_decode = kind == "decode" or (kind == "mixed" and draw(st.booleans()))
        q = 1 if is_decode else draw(st.sampled_from([kv, draw(st.integers(1, kv))]))
        q = min(q, geometry.num_tokens - tokens)
        if q < 1:
            break
        seqs.append((q, max(kv, q)))
        tokens += q
    options = {**draw(st.sampled_from(OPTIONS)), "shared_blocks": draw(st.sampled_from([0, 2, 7]))}
    return seqs, geometry, options


def _hypothesis_check(impls, batch, seed):
    seqs, geometry, options = batch
    options = dict(options)
    case = build_case(seqs, geometry, seed=seed, shared_blocks=options.pop("shared_blocks"))
    for impl in impls:
        if impl != "native":
            assert_matches_naive(impl, case, **options)
        elif geometry.dtype == "float32":  # float32 only; the dispatcher sends others to xla
            for isa in runnable_levels():
                with pytest.MonkeyPatch.context() as monkeypatch:
                    monkeypatch.setenv(ISA_ENV, isa)
                    assert_matches_naive(impl, case, **options)


# Each example runs every implementation, the interpreted ones costing the most: a few under
# `ci`, where the named cases cover every geometry; the slow test runs the thorough budget.
@examples(15)
@given(batch=ragged_batches(), seed=st.integers(0, 2**16))
def test_hypothesis_cpu_impls(batch, seed):
    _hypothesis_check(["reference", "interpret", "xla", "native"], batch, seed)


@examples(5)
@given(batch=ragged_batches(), seed=st.integers(0, 2**16))
def test_hypothesis_triton(batch, seed):
    _hypothesis_check(["triton"], batch, seed)


@pytest.mark.slow
@examples(30, THOROUGH)  # 300 examples, as before the profiles
@given(batch=ragged_batches(), seed=st.integers(0, 2**16))
def test_hypothesis_all_cpu_impls_slow(batch, seed):
    """The thorough budget over every CPU-run implementation: test_hypothesis_cpu_impls and
    test_hypothesis_triton cover them by default."""
    _hypothesis_check(["reference", "interpret", "xla", "native", "triton"], batch, seed)


@pytest.mark.slow
@examples(4, THOROUGH)
@given(batch=ragged_batches(), seed=st.integers(0, 2**16))
def test_hypothesis_mosaic_slow(batch, seed):
    """The TPU interpreter costs about a second a call: test_mosaic_named_case runs its named
    cases by default."""
    _hypothesis_check(["mosaic"], batch, seed)
