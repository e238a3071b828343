"""`x @ w[layer]` for a weight stacked on a leading layer axis: the model's projections.

XLA's dot needs its operand on its own, so under the model's `lax.scan` each layer's weight is
first copied out of the stack; at a few tokens per step, where a step is bound by reading the
weights, that copy is a second pass over them and XLA's dot reads at well under the machine's
bandwidth. On CPU in float32, steps of at most `NATIVE_MAX_TOKENS` tokens therefore run the
native kernel (`native/skinny_matmul_cpu.cc`), which streams the layer's rows where they lie.
Larger steps are matrix products where XLA's dot wins; other backends and dtypes, and machines
where the kernel cannot be built, always use XLA's dot.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jserve.pallas.native_build import load as load_native_kernels

TARGET = "jserve_skinny_matmul_f32"
# Measured on a 2-core AVX2 CPU as whole SmolLM2 model steps, native against XLA's dot: 1.3x
# faster at 1 token, 1.4x at 4 and 8, 1.1x at 16, 0.93x at 32 (XLA's dot wins once the step is
# compute-bound); bench/kernels.py's matmul rows time the projections alone.
NATIVE_MAX_TOKENS = 16
MATMUL_IMPLS = ("xla", "native")


def choose_matmul_impl(backend: str | None = None, dtype: jnp.dtype = jnp.float32) -> str:
    """ "native" on CPU for float32 where the kernel builds, else "xla"."""
    on_cpu = (backend or jax.default_backend()) == "cpu"
    if on_cpu and jnp.dtype(dtype) == jnp.float32 and load_native_kernels() is not None:
        return "native"
    return "xla"


def layer_matmul(x: jax.Array, w: jax.Array, layer: jax.Array, impl: str = "xla") -> jax.Array:
    """x [T, K] @ w[layer] with w [L, K, N] and `layer` an int32 scalar (traced): [T, N].

    impl "native" runs the native kernel when T <= NATIVE_MAX_TOKENS and XLA's dot otherwise
    (choose it with `choose_matmul_impl`); "xla" always runs XLA's dot.
    """
    if impl not in MATMUL_IMPLS:
        raise ValueError(f"matmul impl must be one of {MATMUL_IMPLS}, got {impl!r}")
    if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
        raise ValueError(f"layer_matmul needs x [T, K] and w [L, K, N]; got {x.shape}, {w.shape}")
    if impl == "native" and x.shape[0] <= NATIVE_MAX_TOKENS:
        if x.dtype != jnp.float32 or w.dtype != jnp.float32:
            raise ValueError(f"matmul impl 'native' needs float32; got {x.dtype} and {w.dtype}")
        if load_native_kernels() is None:  # registers the kernel's FFI target
            raise ValueError("matmul impl 'native' needs the native CPU kernels (see the log)")
        kernel = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[2]), x.dtype))
        return kernel(x, w, jnp.asarray(layer, jnp.int32))
    return x @ jax.lax.dynamic_index_in_dim(w, layer, axis=0, keepdims=False)
