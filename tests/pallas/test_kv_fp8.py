"""float8 KV pools (--kv-cache-dtype fp8_e4m3, its vLLM spelling fp8, and fp8_e5m2): the
per-token quantization against ml_dtypes' float8 rounding in numpy, its error bound, its write
beside the pool, the XLA and reference attention over float8 pools against float64 numpy
attention over the dequantized K/V, and where float8 pools are offered and refused.

XLA converts float8 on the CPU, so the attention that serves float8 on a GPU runs here. Slots
an implementation must not read hold a float8 NaN and a NaN scale, so any read of them reaches
the output as NaN.
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jserve.config.engine_args import EngineArgs, add_engine_arguments, engine_args_from_namespace
from jserve.engine.setup import step_shapes
from jserve.layers.attention import PagedAttentionMetadata, attention
from jserve.pallas import choose_impl, ragged_paged_attention
from jserve.pallas.kv_cache import (
    dequantize_kv,
    kv_cache_dtype_of,
    kv_pool_dtype,
    kv_scales_shape,
    quantize_kv,
    rotate_heads,
)
from tests.aot.test_compile import SMOLLM2_135M
from tests.pallas.ragged_cases import (
    QUANTIZED_POOL_CASES as CASES,
)
from tests.pallas.ragged_cases import (
    RaggedCase,
    build_case,
    naive_attention,
    padding_rows,
    quantized_case,
    relative_error,
)

# dtype -> (mantissa bits, the smallest subnormal step): a normal value's rounding error is at
# most 2^-(mantissa + 1) of it, a subnormal one's half the step
FORMATS = {
    "float8_e4m3fn": (3, 2.0**-9),
    "float8_e5m2": (2, 2.0**-16),
}


def _heavy_tailed(shape: tuple[int, ...], seed: int) -> np.ndarray:
    """Student-t (3 degrees of freedom) rows over six decades of scale, one channel 30x."""
    rng = np.random.default_rng(seed)
    x = rng.standard_t(3, shape) * rng.uniform(1e-3, 1e3, (*shape[:-1], 1))
    x[..., 5] *= 30.0
    return x.astype(np.float32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_round_trip_is_ml_dtypes_rounding_within_half_a_float8_step(name):
    dtype = jnp.dtype(getattr(ml_dtypes, name))
    qmax = float(ml_dtypes.finfo(dtype).max)  # 448 for e4m3fn, 57344 for e5m2
    x = _heavy_tailed((256, 3, 64), seed=0)
    x[5, 1] = 0.0  # an all-zero row: scale 0, exact zeros
    q, scale = (np.asarray(a) for a in quantize_kv(jnp.asarray(x), dtype))
    assert q.dtype == dtype and scale.dtype == np.float32 and scale.shape == (256, 3)
    np.testing.assert_allclose(scale, np.abs(x.astype(np.float64)).max(-1) / qmax, rtol=1e-6)
    # numpy's reference: the scaled float32 values rounded to float8 by ml_dtypes
    safe = np.where(scale > 0, scale, 1.0)[..., None]
    want = (x / safe).astype(dtype)
    np.testing.assert_array_equal(q.view(np.uint8), want.view(np.uint8))
    assert np.all(np.isfinite(q.astype(np.float32)))
    assert np.all(np.abs(q.astype(np.float32)).max(-1)[scale > 0] == qmax)  # absmax -> qmax
    back = np.asarray(dequantize_kv(jnp.asarray(q), jnp.asarray(scale))).astype(np.float64)
    mantissa, step = FORMATS[name]
    x64, scale64 = x.astype(np.float64), scale.astype(np.float64)[..., None]
    bound = np.maximum(np.abs(x64) * 2.0 ** -(mantissa + 1), scale64 * step / 2) * (1 + 1e-5)
    assert np.all(np.abs(back - x64) <= bound)
    assert scale[5, 1] == 0 and np.all(back[5, 1] == 0)


def _attend(case: RaggedCase, pools: tuple, impl: str, **options) -> np.ndarray:
    k8, v8, ks, vs = pools
    out = ragged_paged_attention(
        *map(jnp.asarray, (case.q, k8, v8, case.block_tables, case.cu_q_lens, case.kv_lens)),
        jnp.asarray(case.num_seqs), jnp.asarray(case.layer),
        sm_scale=case.q.shape[-1] ** -0.5, impl=impl, kv_scales=(jnp.asarray(ks), jnp.asarray(vs)),
        **options,
    )  # fmt: skip
    return np.asarray(out)


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("impl", ["reference", "xla", "triton"])  # Triton interpreted here
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_fp8_pools_match_float64_attention_over_the_dequantized_values(dtype, impl, name):
    seqs, geometry, options = CASES[name]
    case = build_case(seqs, geometry, seed=len(name))
    pools, dequant = quantized_case(case, jnp.dtype(dtype))
    out = _attend(case, pools, impl, **options)
    sm_scale = geometry.head_dim**-0.5
    ref = naive_attention(dequant, sm_scale, options.get("sliding_window"), options.get("soft_cap"))
    assert out.dtype == np.float32 and not np.isnan(out).any(), f"{impl}: NaN in the output"
    assert relative_error(case, out, ref) <= 1e-5
    assert np.all(padding_rows(case, out) == 0)


def test_fp8_attention_is_close_to_the_float_pools():
    """What e4m3's three mantissa bits cost an attention output: a few hundredths of its
    scale (int8 with the rotation costs less: test_kv_int8)."""
    case = build_case(*CASES["decode_and_prefill"][:2], seed=3)
    pools, _ = quantized_case(case, jnp.dtype(jnp.float8_e4m3fn))
    ref = naive_attention(case, 64**-0.5, None, None)
    assert relative_error(case, _attend(case, pools, "xla"), ref) < 5e-2


def test_the_attention_layer_writes_fp8_pools_rotated():
    """As int8 pools do, a float8 pool holds K and V Hadamard-rotated (kv_cache): the layer's
    write is quantize_kv of rotate_heads(k), and its output is rotated back."""
    heads, d, bs, t = 3, 64, 16, 5
    rng = np.random.default_rng(2)
    q = jnp.asarray(rng.standard_normal((t, 9, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((t, heads, d)), jnp.float32) for _ in range(2))
    dtype = jnp.dtype(jnp.float8_e4m3fn)
    pool = jnp.zeros((1, 3, heads, bs, d), dtype)
    scales = jnp.zeros(kv_scales_shape(1, 3, bs, heads), jnp.float32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    meta = PagedAttentionMetadata(
        slot_mapping=i32(np.arange(t) + bs), block_tables=i32([[1, 0]]), cu_q_lens=i32([0, t]),
        kv_lens=i32([t]), num_seqs=i32([1]), impl="xla",
    )  # fmt: skip
    out, cache = attention(q, k, v, (pool, pool, scales, scales), meta, i32(0), sm_scale=0.125)
    want_q, want_s = quantize_kv(rotate_heads(k), dtype)
    written = np.asarray(cache[0][0, 1, :, :t]).transpose(1, 0, 2)  # [t, heads, d]
    np.testing.assert_array_equal(written.view(np.uint8), np.asarray(want_q).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(cache[2][0, 1, :, :t]).T, np.asarray(want_s))
    # one sequence of t tokens at positions 0..t-1: causal attention over the dequantized,
    # rotated-back K and V
    back_k, back_v = (
        np.asarray(rotate_heads(dequantize_kv(c[0, 1, :, :t], s[0, 1, :, :t])), np.float64)
        for c, s in ((cache[0], cache[2]), (cache[1], cache[3]))
    )
    qg = np.asarray(q, np.float64).reshape(t, heads, 3, d)
    scores = np.einsum("tkgd,ksd->kgts", qg, back_k) * 0.125
    scores[..., np.triu(np.ones((t, t), bool), 1)] = -np.inf
    probs = np.exp(scores - scores.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ref = np.einsum("kgts,ksd->tkgd", probs, back_v).reshape(t, 9, d)
    np.testing.assert_allclose(np.asarray(out), ref, atol=1e-5)


def test_fp8_pools_go_to_the_implementations_that_read_them():
    assert choose_impl("cpu", jnp.float32, "fp8_e4m3") == "xla"  # native reads int8 only
    assert choose_impl("cpu", jnp.float32, "int8") == choose_impl("cpu", jnp.float32)
    assert choose_impl("gpu", jnp.bfloat16, "fp8") == "triton"
    assert choose_impl("gpu", jnp.bfloat16, "fp8_e5m2") == "triton"
    assert choose_impl("gpu", jnp.bfloat16) == "triton"


@pytest.mark.parametrize("impl", ["interpret", "mosaic", "native"])
def test_fp8_pools_are_refused_by_the_kernels_that_do_not_read_them(impl):
    # Mosaic's layout packs two tokens of head_dim 64 per 128-lane row (kv_cache)
    shape = (2, 9, 3, 8, 128) if impl == "mosaic" else (2, 9, 3, 16, 64)
    pool = jnp.zeros(shape, jnp.float8_e4m3fn)
    scale = jnp.zeros((2, 9, 3, 16), jnp.float32)
    i32 = jnp.zeros
    with pytest.raises(
        ValueError, match=r"fp8_e4m3 KV pools are read by impl \['reference', 'xla', 'triton'\]"
    ):
        ragged_paged_attention(
            jnp.zeros((4, 9, 64)), pool, pool, i32((2, 3), jnp.int32), i32(3, jnp.int32),
            i32(2, jnp.int32), i32(1, jnp.int32), jnp.int32(0), sm_scale=0.125, impl=impl,
            kv_scales=(scale, scale),
        )  # fmt: skip


def test_vllms_fp8_is_fp8_e4m3():
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    args = engine_args_from_namespace(parser.parse_args(["--kv-cache-dtype", "fp8"]))
    assert args.kv_cache_dtype == "fp8"
    assert kv_pool_dtype("fp8", jnp.bfloat16) == jnp.dtype(jnp.float8_e4m3fn)
    assert kv_pool_dtype("fp8_e5m2", jnp.bfloat16) == jnp.dtype(jnp.float8_e5m2)
    assert kv_cache_dtype_of(jnp.float8_e4m3fn) == "fp8_e4m3"
    assert kv_cache_dtype_of(jnp.bfloat16) == "auto" and kv_cache_dtype_of(jnp.int8) == "int8"
    fp8, e4m3 = (
        step_shapes(EngineArgs(kv_cache_dtype=n), SMOLLM2_135M, "gpu") for n in ("fp8", "fp8_e4m3")
    )
    assert fp8 == e4m3


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_a_gpu_pool_has_int8s_blocks_and_triton_attention(name):
    memory = 1 << 30
    shapes, int8 = (
        step_shapes(EngineArgs(kv_cache_memory=memory, kv_cache_dtype=n), SMOLLM2_135M, "gpu")
        for n in (name, "int8")
    )
    # SmolLM2: 30 layers x 3 KV heads x 16 tokens, K and V, a byte and a quarter scale each
    assert shapes.block_bytes == int8.block_bytes == 2 * 30 * 3 * 16 * (64 + 4)
    assert shapes.num_blocks == memory // shapes.block_bytes
    assert shapes.attn_impl == "triton"


@pytest.mark.parametrize("platform", ["cpu", "tpu"])
def test_serving_fp8_off_a_gpu_is_refused_pointing_at_int8(platform):
    args = EngineArgs(kv_cache_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match=rf"runs on GPU .*; {platform} has no float8 storage: "
                       "use --kv-cache-dtype int8"):  # fmt: skip
        step_shapes(args, SMOLLM2_135M, platform)


def test_fp8_on_a_gpu_refuses_the_interpreter():
    args = EngineArgs(kv_cache_dtype="fp8", attention_impl="interpret")
    with pytest.raises(ValueError, match="fp8 is read by --attention-impl reference, xla, triton "):
        step_shapes(args, SMOLLM2_135M, "gpu")
