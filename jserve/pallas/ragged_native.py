"""Ragged paged attention in a native CPU kernel: the CPU serving path (float32 queries, over
float32 pools or int8 pools with their scales).

The kernel (`native/ragged_attention_cpu.cc`, built by `native_build`) follows ragged_common's
contract for every row, decode and prefill alike: it reads each page straight from the pool,
only the positions some row of a work unit may see, once for all of the unit's rows, and
spreads the units over XLA's intra-op threads. ragged_xla's loops run their small dots one
after the other on one thread, and a decode row there gathers its pages into a copy before it
reads them (bench/RESULTS.md, "Kernels", compares the two). Other dtypes, and machines where
the kernel cannot be built, use ragged_xla.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from jserve.pallas.native_build import load as load_native_kernels
from jserve.pallas.ragged_common import RaggedCall

TARGET = "jserve_ragged_attention_f32"
INT8_TARGET = "jserve_ragged_attention_int8"  # int8 pools and their scales


def native_supports(dtype: jnp.dtype) -> bool:
    """Whether the native kernel can run this dtype on this machine (building it if need be)."""
    return jnp.dtype(dtype) == jnp.float32 and load_native_kernels() is not None


def ragged_paged_attention_native(call: RaggedCall) -> jax.Array:
    """Ragged paged attention through the native kernel; see `ragged_paged_attention`."""
    kernels = load_native_kernels() if call.q.dtype == jnp.float32 else None
    if kernels is None:
        raise ValueError(
            f"impl='native' needs float32 and a native kernel built on this machine (see the "
            f"log); got {call.q.dtype}"
        )
    return _attend(call, kernels.target(INT8_TARGET if call.kv_scales else TARGET))


@functools.partial(jax.jit, static_argnames="target")
def _attend(call: RaggedCall, target: str) -> jax.Array:
    """The kernel's call, jitted per FFI target: each ISA level's build has its own."""
    kernel = jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(call.q.shape, jnp.float32))
    return kernel(
        call.q, call.k_pool, call.v_pool, *(call.kv_scales or ()), call.block_tables,
        call.cu_q_lens, call.kv_lens, call.num_seqs.reshape(1), call.layer,
        sm_scale=np.float32(call.sm_scale),
        sliding_window=np.int64(call.sliding_window or 0),
        soft_cap=np.float32(call.soft_cap or 0.0),
    )  # fmt: skip
