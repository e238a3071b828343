"""Kernels: the paged KV pool layout, its write, and ragged paged attention (jax only)."""

from jserve.pallas.kv_cache import kv_cache_shape, validate_slot_mapping, write_kv
from jserve.pallas.ragged_common import validate_attention_shapes, validate_attention_values

__all__ = [
    "kv_cache_shape",
    "validate_attention_shapes",
    "validate_attention_values",
    "validate_slot_mapping",
    "write_kv",
]
