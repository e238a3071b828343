"""`x @ w[layer]` for a weight stacked on a leading layer axis: the model's projections.

Two layouts of the same weight (`MatmulImpl`), chosen once per model by `choose_matmul_impl`:
- "xla": w is [L, K, N] and the product is XLA's dot on `w[layer]`. Under the model's
  `lax.scan` XLA first copies each layer's slice out of the stack, and its CPU dot packs its
  operand on every call, which at a few tokens per step is a second pass over the weights;
- "native" (CPU, float32): w is packed once at load time by `pack_layer_weight` into column
  panels [L, ceil(N / 16), K, 16], and `native/packed_matmul_cpu.cc` streams the layer's panels
  where they lie, register-blocked over the step's rows, so each step reads the weights once
  (`bench.kernel_timings`' matmul rows compare the two; bench/RESULTS.md has measured figures).
Other backends and dtypes, sharded models and machines where the kernel cannot be built use
"xla".
"""

from __future__ import annotations

from enum import StrEnum

import jax
import jax.numpy as jnp

from jserve.pallas.native_build import load as load_native_kernels

TARGET = "jserve_packed_matmul_f32"
PANEL = 16  # columns per packed panel (the kernel's register block width)


class MatmulImpl(StrEnum):
    """How the layers' projections run, and so how their weights are laid out."""

    XLA = "xla"
    NATIVE = "native"


MATMUL_IMPLS = tuple(MatmulImpl)


def choose_matmul_impl(backend: str | None = None, dtype: jnp.dtype = jnp.float32) -> MatmulImpl:
    """NATIVE on CPU for float32 where the kernel builds, else XLA."""
    on_cpu = (backend or jax.default_backend()) == "cpu"
    if on_cpu and jnp.dtype(dtype) == jnp.float32 and load_native_kernels() is not None:
        return MatmulImpl.NATIVE
    return MatmulImpl.XLA


def pack_layer_weight(w: jax.Array, impl: MatmulImpl | str) -> jax.Array:
    """w [L, K, N] in the layout `layer_matmul(..., impl)` reads: unchanged for "xla"; for
    "native" [L, ceil(N / 16), K, 16], panel p holding columns 16p..16p+15 with K rows of 16
    contiguous floats, zero columns padding N up to a multiple of 16."""
    _check_impl(impl)
    if w.ndim != 3:
        raise ValueError(f"pack_layer_weight needs w [L, K, N]; got {w.shape}")
    if impl == MatmulImpl.XLA:
        return w
    L, K, N = w.shape
    panels = -(-N // PANEL)
    w = jnp.pad(w, ((0, 0), (0, 0), (0, panels * PANEL - N)))
    return w.reshape(L, K, panels, PANEL).transpose(0, 2, 1, 3)


def layer_matmul(
    x: jax.Array,
    w: jax.Array,
    layer: jax.Array,
    impl: MatmulImpl | str = MatmulImpl.XLA,
    n: int | None = None,
    rows: jax.Array | None = None,
) -> jax.Array:
    """x [T, K] @ layer `layer` (an int32 scalar, traced) of w, laid out for `impl` by
    `pack_layer_weight`: [T, N]. The "native" layout pads N, so it needs `n`, the true N.

    `rows` (an int32 scalar, traced; default T) is how many leading rows of x are wanted: a
    step's real tokens, the rest being its bucket's padding. "native" computes only those and
    writes zeros past them; XLA's dot computes every row, so the caller must not read past
    `rows` either way."""
    _check_impl(impl)
    if impl == MatmulImpl.XLA:
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
            raise ValueError(
                f"layer_matmul needs x [T, K] and w [L, K, N]; got {x.shape}, {w.shape}"
            )
        return x @ jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
    if x.ndim != 2 or w.ndim != 4 or w.shape[3] != PANEL or x.shape[1] != w.shape[2]:
        raise ValueError(
            "matmul impl 'native' needs x [T, K] and w packed by pack_layer_weight "
            f"[L, ceil(N / {PANEL}), K, {PANEL}]; got {x.shape}, {w.shape}"
        )
    if n is None or not (w.shape[1] - 1) * PANEL < n <= w.shape[1] * PANEL:
        raise ValueError(f"matmul impl 'native' needs n, N of the weight packed as {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul impl 'native' needs float32; got {x.dtype} and {w.dtype}")
    kernels = load_native_kernels()  # registers the kernel's FFI target
    if kernels is None:
        raise ValueError("matmul impl 'native' needs the native CPU kernels (see the log)")
    result = jax.ShapeDtypeStruct((x.shape[0], n), x.dtype)
    kernel = jax.ffi.ffi_call(kernels.target(TARGET), result)
    rows = x.shape[0] if rows is None else rows
    return kernel(x, w, jnp.asarray(layer, jnp.int32), jnp.asarray(rows, jnp.int32))


def _check_impl(impl: str) -> None:
    if impl not in MATMUL_IMPLS:
        names = tuple(str(name) for name in MatmulImpl)
        raise ValueError(f"matmul impl must be one of {names}, got {impl!r}")
