"""Kernels: the paged KV pool layout, its write, and ragged paged attention (jax only).

`ragged_paged_attention` dispatches by backend to one implementation module, each with the same
anatomy: ragged_reference (jnp), ragged_interpret (coarse-grid Pallas, CPU interpret mode),
ragged_triton (GPU) and ragged_mosaic (TPU); ragged_common holds their shared validators and
masking, kv_cache the pool layout and the KV write.
"""

from jserve.pallas.kv_cache import kv_cache_shape, validate_slot_mapping, write_kv
from jserve.pallas.ragged_attention import IMPLS, choose_impl, ragged_paged_attention
from jserve.pallas.ragged_common import validate_attention_shapes, validate_attention_values

__all__ = [
    "IMPLS",
    "choose_impl",
    "kv_cache_shape",
    "ragged_paged_attention",
    "validate_attention_shapes",
    "validate_attention_values",
    "validate_slot_mapping",
    "write_kv",
]
