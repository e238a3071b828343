"""`x @ w[layer]` for a weight stacked on a leading layer axis: the model's projections.

Two layouts of a float weight (`MatmulImpl`), chosen once per model by `choose_matmul_impl`:
- "xla": w is [L, K, N] and the product is XLA's dot on `w[layer]`. Under the model's
  `lax.scan` XLA first copies each layer's slice out of the stack, and its CPU dot packs its
  operand on every call, which at a few tokens per step is a second pass over the weights;
- "native" (CPU, float32): w is packed once at load time by `pack_layer_weight` into column
  panels [L, ceil(N / 16), K, 16], and `native/packed_matmul_cpu.cc` streams the layer's panels
  where they lie, register-blocked over the step's rows, so each step reads the weights once
  (`bench.kernel_timings`' matmul rows compare the two; bench/RESULTS.md has measured figures).
Other backends and dtypes, sharded models and machines where the kernel cannot be built use
"xla".

Under "native", a weight may also be a GGUF file's quantized blocks, packed once at load time
by jserve.pallas.quant_blocks into one uint8 array: `native/quant_matmul_cpu.cc` turns them into
float32 in registers and gives the bits the float32 kernel gives on the dequantized weight. A
weight's dtype says which it is (uint8: packed blocks).

Under "xla", a weight may also be int8 with float scales per group of k of each output column
(jserve.models.int8_weights, --quantization int8): qwix's dot_general converts and scales it
inside the dot (XLA fuses the conversion into the matmul on TPU and GPU).
"""

from __future__ import annotations

from enum import StrEnum

import jax
import jax.numpy as jnp
import qwix

from jserve.pallas.native_build import load as load_native_kernels
from jserve.pallas.ragged_common import dot_precision

TARGET = "jserve_packed_matmul_f32"
QUANT_TARGET = "jserve_quant_matmul_f32"
COLUMNS_TARGET = "jserve_quant_columns_f32"
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
    scale: jax.Array | None = None,
) -> jax.Array:
    """x [T, K] @ layer `layer` (an int32 scalar, traced) of w, laid out for `impl` by
    `pack_layer_weight` (or, for "native", GGUF blocks packed by
    jserve.pallas.quant_blocks.pack_weight): [T, N]. The "native" layouts pad N, so they need
    `n`, the true N.

    `rows` (an int32 scalar, traced; default T) is how many leading rows of x are wanted: a
    step's real tokens, the rest being its bucket's padding. "native" computes only those and
    writes zeros past them; XLA's dot computes every row, so the caller must not read past
    `rows` either way.

    `scale` [L, K / G, N] (float; "xla" only) makes w int8 quants, the weight being w times
    the scale of its group of G k (jserve.models.int8_weights)."""
    _check_impl(impl)
    if impl == MatmulImpl.XLA:
        if is_packed_blocks(w):
            raise ValueError("packed GGUF blocks run on matmul impl 'native' only")
        if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
            raise ValueError(
                f"layer_matmul needs x [T, K] and w [L, K, N]; got {x.shape}, {w.shape}"
            )
        w = jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
        if scale is None:
            return jnp.matmul(x, w, precision=dot_precision(x, w))
        scale = jax.lax.dynamic_index_in_dim(scale, layer, axis=0, keepdims=False)  # [G, N]
        return qwix.dot_general(x, qwix.QArray(w, scale), (((1,), (0,)), ((), ())))
    if scale is not None:
        raise ValueError("int8 weights with scales run on matmul impl 'xla' (native: packed)")
    if n is None or n < 1:
        raise ValueError(f"matmul impl 'native' needs n, N of the weight packed as {w.shape}")
    if is_packed_blocks(w):
        if x.ndim != 2 or w.ndim != 1 or x.dtype != jnp.float32:
            raise ValueError(
                "packed GGUF blocks need x [T, K] float32 and the uint8 array "
                f"jserve.pallas.quant_blocks.pack_weight made; got {x.shape} {x.dtype}, {w.shape}"
            )
        return _native_call(QUANT_TARGET, x, w, layer, n, rows)
    if x.ndim != 2 or w.ndim != 4 or w.shape[3] != PANEL or x.shape[1] != w.shape[2]:
        raise ValueError(
            "matmul impl 'native' needs x [T, K] and w packed by pack_layer_weight "
            f"[L, ceil(N / {PANEL}), K, {PANEL}]; got {x.shape}, {w.shape}"
        )
    if not (w.shape[1] - 1) * PANEL < n <= w.shape[1] * PANEL:
        raise ValueError(f"matmul impl 'native' needs n, N of the weight packed as {w.shape}")
    if x.dtype != jnp.float32 or w.dtype != jnp.float32:
        raise ValueError(f"matmul impl 'native' needs float32; got {x.dtype} and {w.dtype}")
    return _native_call(TARGET, x, w, layer, n, rows)


def packed_columns(w: jax.Array, ids: jax.Array, k: int) -> jax.Array:
    """Columns `ids` [T] of layer 0 of a weight [1, K, N] laid out for "native" (float panels
    or packed GGUF blocks): [T, K] float32. A tied embedding's lookup reads the output head's
    packed weight so. Ids past N are clamped."""
    if not is_packed_blocks(w):
        return w[0, ids // PANEL, :, ids % PANEL]
    result = jax.ShapeDtypeStruct((ids.shape[0], k), jnp.float32)
    return jax.ffi.ffi_call(_native_kernels().target(COLUMNS_TARGET), result)(ids, w)


def is_packed_blocks(w: jax.Array) -> bool:
    """Whether `w` is GGUF blocks packed by jserve.pallas.quant_blocks (a uint8 array)."""
    return w.dtype == jnp.uint8


def _native_kernels():
    kernels = load_native_kernels()  # registers the kernels' FFI targets
    if kernels is None:
        raise ValueError("matmul impl 'native' needs the native CPU kernels (see the log)")
    return kernels


def _native_call(target: str, x, w, layer, n: int, rows) -> jax.Array:
    result = jax.ShapeDtypeStruct((x.shape[0], n), x.dtype)
    kernel = jax.ffi.ffi_call(_native_kernels().target(target), result)
    rows = x.shape[0] if rows is None else rows
    return kernel(x, w, jnp.asarray(layer, jnp.int32), jnp.asarray(rows, jnp.int32))


def _check_impl(impl: str) -> None:
    if impl not in MATMUL_IMPLS:
        names = tuple(str(name) for name in MatmulImpl)
        raise ValueError(f"matmul impl must be one of {names}, got {impl!r}")
