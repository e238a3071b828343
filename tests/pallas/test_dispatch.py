"""The dispatcher, the engine's layer-scan pattern, and GPU/TPU kernels lowering on this CPU."""

from __future__ import annotations

import dataclasses
import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.lax import Precision

from jserve.layers.attention import dense_causal_attention
from jserve.pallas import IMPLS, choose_impl, native_build, ragged_paged_attention, write_kv
from jserve.pallas.layer_matmul import choose_matmul_impl, layer_matmul
from jserve.pallas.ragged_native import native_supports
from tests.pallas.native_levels import NATIVE, use_native_level
from tests.pallas.ragged_cases import (
    TOLERANCE,
    Geometry,
    build_case,
    naive_attention,
    relative_error,
    traced_equations,
)

CASE = build_case([(1, 40), (5, 21), (1, 1)], Geometry())
# Kernels for accelerators this machine lacks: (impl, lowering platform, marker in the HLO).
LOWERED = [("triton", "cuda", "__gpu$xla.gpu.triton"), ("mosaic", "tpu", "tpu_custom_call")]


def _args(case=CASE, impl="reference"):
    return [jnp.asarray(a) for a in case.args(impl)]


def test_choose_impl_by_backend(native_kernels):
    assert [choose_impl(b) for b in ("cpu", "gpu", "cuda", "tpu", "rocm")] == [
        "native", "triton", "triton", "mosaic", "reference",
    ]  # fmt: skip
    assert choose_impl() == "native"  # the tests run on CPU
    assert choose_impl("cpu", jnp.bfloat16) == "xla"  # the native kernel is float32 only


def test_auto_is_the_native_path_on_cpu(native_kernels):
    auto = ragged_paged_attention(*_args(), sm_scale=0.125)
    native = ragged_paged_attention(*_args(), sm_scale=0.125, impl="native")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(native))


@pytest.mark.parametrize(
    ("compiler", "reason"),
    [("missing-c++", r"\$CXX=\S*missing-c\+\+ is not a program"), ("false", "failed")],
)
def test_cpu_falls_back_to_xla_without_a_native_kernel(
    monkeypatch, tmp_path, caplog, compiler, reason
):
    """No C++ compiler ($CXX names no program and PATH has no g++ or clang++), or one that
    fails: one warning naming why however often the dispatchers ask, "auto" on CPU is the XLA
    path, and a native test skips with the reason."""
    monkeypatch.setenv(
        "CXX", shutil.which("false") if compiler == "false" else str(tmp_path / compiler)
    )
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("JSERVE_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native_build, "_loaded", {})
    native_build._warn_once.cache_clear()
    try:
        with caplog.at_level("WARNING", logger=native_build.__name__):
            assert choose_impl("cpu") == "xla"
            assert choose_matmul_impl("cpu") == "xla"
            assert not native_supports(jnp.float32)
        [warning] = [r.getMessage() for r in caplog.records if r.name == native_build.__name__]
        assert "plain XLA" in warning
        assert re.search(reason, warning), warning
        with pytest.raises(pytest.skip.Exception, match=reason):
            use_native_level(monkeypatch, "portable")
    finally:
        native_build._warn_once.cache_clear()


def test_native_rejects_other_dtypes():
    args = _args(build_case([(1, 20)], Geometry(dtype="bfloat16")))
    with pytest.raises(ValueError, match="impl='native' needs float32"):
        ragged_paged_attention(*args, sm_scale=0.125, impl="native")


@pytest.mark.parametrize("impl", [*(impl for impl in IMPLS if impl != "native"), *NATIVE])
def test_every_listed_impl_dispatches_and_is_right(impl):
    """Each name in IMPLS is accepted by the entry and reaches an implementation that computes
    the float64 answer (accelerator kernels interpreted here), so the list and the dispatch
    cannot drift apart."""
    interpret = True if impl in ("triton", "mosaic") else None
    out = ragged_paged_attention(*_args(impl=impl), sm_scale=0.125, impl=impl, interpret=interpret)
    ref = naive_attention(CASE, 0.125, None, None)
    assert relative_error(CASE, np.asarray(out), ref) <= TOLERANCE[np.dtype("f4")]


@pytest.mark.parametrize(
    ("impl", "interpret", "message"),
    [
        ("cuda", None, "impl must be 'auto' or one of"),
        ("reference", True, "impl='reference' has no interpret mode"),
        ("xla", False, "impl='xla' has no interpret mode"),
        ("native", True, "impl='native' has no interpret mode"),
        ("interpret", False, "impl=.interpret. only runs in interpret mode"),
    ],
)
def test_dispatch_rejects_bad_choices(impl, interpret, message):
    with pytest.raises(ValueError, match=message):
        ragged_paged_attention(*_args(), sm_scale=0.125, impl=impl, interpret=interpret)


@pytest.mark.parametrize("impl", ["reference", "interpret", "xla", *NATIVE])
def test_write_then_attend_inside_layer_scan(impl):
    """The engine's step: scan over layers carrying both pools, write K/V then attend, with a
    traced layer index; each layer must see only its own cache."""
    num_layers = 3
    case = build_case([(1, 40), (6, 22), (1, 16)], Geometry(num_layers=num_layers, layer=0))
    bs = case.k_pool.shape[3]
    # Layer l's cache is layer 0's scaled, so every layer has a different right answer.
    k_all = np.stack([case.k_pool[0] * (1 + layer) for layer in range(num_layers)])
    v_all = np.stack([case.v_pool[0] - layer for layer in range(num_layers)])
    slots = np.zeros(case.q.shape[0], np.int32)  # pad tokens write the sink block
    for s, (q_len, kv_len) in enumerate(case.seqs):
        for i in range(q_len):
            pos = kv_len - q_len + i
            slots[case.cu_q_lens[s] + i] = case.block_tables[s, pos // bs] * bs + pos % bs
    blocks, offsets = slots // bs, slots % bs
    new_k = k_all[:, blocks, :, offsets].transpose(1, 0, 2, 3)  # [L, T, Hkv, D]
    new_v = v_all[:, blocks, :, offsets].transpose(1, 0, 2, 3)
    k_stale, v_stale = k_all.copy(), v_all.copy()
    k_stale[:, blocks, :, offsets] = np.nan  # this step's slots hold stale NaN until written
    v_stale[:, blocks, :, offsets] = np.nan

    @functools.partial(jax.jit, donate_argnums=(0, 1))
    def step(k_pool, v_pool, new_k, new_v, slots, q, tables, cu, kv_lens, num_seqs):
        def layer_body(pools, xs):
            layer, k, v = xs
            k_pool, v_pool = write_kv(*pools, k, v, slots, layer, impl=impl)
            out = ragged_paged_attention(
                q, k_pool, v_pool, tables, cu, kv_lens, num_seqs, layer, sm_scale=0.125,
                impl=impl,
            )  # fmt: skip
            return (k_pool, v_pool), out

        xs = (jnp.arange(num_layers, dtype=jnp.int32), new_k, new_v)
        return jax.lax.scan(layer_body, (k_pool, v_pool), xs)

    (k_out, _), outs = step(
        *map(jnp.asarray, (k_stale, v_stale, new_k, new_v, slots, case.q, case.block_tables)),
        *map(jnp.asarray, (case.cu_q_lens, case.kv_lens, case.num_seqs)),
    )
    for layer in range(num_layers):
        full = dataclasses.replace(case, k_pool=k_all, v_pool=v_all, layer=np.int32(layer))
        ref = naive_attention(full, 0.125, None, None)
        assert relative_error(full, np.asarray(outs[layer]), ref) <= TOLERANCE[np.dtype("f4")]
    live = ~np.isnan(k_all)
    np.testing.assert_array_equal(np.asarray(k_out)[live], k_all[live])


LOWERING_CASES = {
    "smollm_f32": (Geometry(), {}),
    "gqa8_d128_bf16_window_cap": (
        Geometry(num_q_heads=8, num_kv_heads=1, head_dim=128, block_size=32, dtype="bfloat16"),
        dict(sliding_window=64, soft_cap=30.0),
    ),
}


@pytest.mark.parametrize(("impl", "platform", "marker"), LOWERED)
@pytest.mark.parametrize("name", sorted(LOWERING_CASES))
def test_kernel_lowers_for_its_accelerator(impl, platform, marker, name):
    """Pallas -> Triton IR / Mosaic lowering runs here without the device; the device's own
    compiler (ptxas, libtpu) is not exercised."""
    geometry, options = LOWERING_CASES[name]
    case = build_case([(1, 40), (7, 70)], geometry)
    attention = functools.partial(
        ragged_paged_attention, sm_scale=0.1, impl=impl, interpret=False, **options
    )
    lowered = jax.jit(attention).trace(*_args(case, impl)).lower(lowering_platforms=(platform,))
    assert marker in lowered.as_text()


FLOAT32_PROGRAMS = {
    "attention xla": lambda: jax.make_jaxpr(
        functools.partial(ragged_paged_attention, sm_scale=0.125, impl="xla")
    )(*_args(impl="xla")),
    "attention triton": lambda: jax.make_jaxpr(
        functools.partial(ragged_paged_attention, sm_scale=0.125, impl="triton", interpret=True)
    )(*_args(impl="triton")),
    "attention mosaic": lambda: jax.make_jaxpr(
        functools.partial(ragged_paged_attention, sm_scale=0.125, impl="mosaic", interpret=True)
    )(*_args(impl="mosaic")),
    "dense causal attention": lambda: jax.make_jaxpr(
        functools.partial(dense_causal_attention, sm_scale=0.125, sliding_window=None)
    )(*(jnp.ones((8, h, 64)) for h in (9, 3, 3))),
    "projection xla": lambda: jax.make_jaxpr(functools.partial(layer_matmul, impl="xla"))(
        jnp.ones((4, 64)), jnp.ones((2, 64, 32)), jnp.int32(1)
    ),
}


@pytest.mark.parametrize("program", sorted(FLOAT32_PROGRAMS))
def test_float32_dots_are_float32_on_every_backend(program):
    """XLA and Pallas take a dot's DEFAULT precision as TF32 on a GPU and bfloat16 passes on a
    TPU: on an H200 float32 attention then missed float64 by 5e-4 relative (its tolerance is
    1e-5). Every dot of these float32 programs must ask for HIGHEST (CPU ignores it, so this
    reads the traced programs)."""
    dots = traced_equations(FLOAT32_PROGRAMS[program]().jaxpr, "dot_general")
    precisions = [eqn.params["precision"] for eqn in dots]
    assert precisions and set(precisions) == {(Precision.HIGHEST, Precision.HIGHEST)}
