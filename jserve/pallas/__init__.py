"""Layer: kernels (jax, and of jserve only the implementation names of jserve.config).

The paged KV pool layout, its write, ragged paged attention, and the layers' matmul.

`ragged_paged_attention` dispatches by backend to one implementation module, each with the same
anatomy: ragged_reference (jnp), ragged_xla (plain XLA loops), ragged_native (a native C++
kernel built by native_build at the ISA level native_isa picks: the CPU serving path for
float32), ragged_interpret (coarse-grid Pallas, CPU interpret mode, for checking kernel
semantics), ragged_triton (GPU) and ragged_mosaic (TPU). ragged_common holds the one call
contract they all take (`RaggedCall`), the validators and the masking; kv_cache the pool
layout, the KV write and the quantized pools' (--kv-cache-dtype int8, fp8_*).
layer_matmul is `x @ w[layer]` for stacked weights, on CPU through a native kernel on weights
packed in column panels at load time. Validators are not re-exported here: import them from
their modules.
"""

from jserve.pallas.kv_cache import kv_cache_shape, write_kv, write_kv_cache
from jserve.pallas.ragged_attention import IMPLS, choose_impl, ragged_paged_attention

__all__ = [
    "IMPLS",
    "choose_impl",
    "kv_cache_shape",
    "ragged_paged_attention",
    "write_kv",
    "write_kv_cache",
]
