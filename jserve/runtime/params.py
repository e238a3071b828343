"""Put a model's parameters on devices: dtype choice, the mesh, and sharded placement."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.models.config import ModelConfig
from jserve.models.llama import MODEL_AXIS, LlamaModel, fuse_projections

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def resolve_dtype(name: str | None) -> Any:
    """float32 on CPU (bfloat16 is 2-4x slower without AVX512-BF16), bfloat16 on GPU/TPU."""
    if name is None or name == "auto":
        return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {['auto', *DTYPES]}, got {name!r}")
    return DTYPES[name]


def make_mesh(tensor_parallel_size: int = 1) -> jax.sharding.Mesh:
    """A 1-D mesh over the first `tensor_parallel_size` devices, axis "model"."""
    devices = jax.devices()
    if not 1 <= tensor_parallel_size <= len(devices):
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size}, but {len(devices)} device(s) are visible"
        )
    # Auto axes: XLA propagates shardings from the annotated weights (no per-op out_sharding).
    return jax.make_mesh(
        (tensor_parallel_size,),
        (MODEL_AXIS,),
        axis_types=(jax.sharding.AxisType.Auto,),
        devices=devices[:tensor_parallel_size],
    )


def place_model(
    cfg: ModelConfig, params: Any, dtype: Any, mesh: jax.sharding.Mesh
) -> tuple[nnx.GraphDef, nnx.State]:
    """Split the model once: a static graph definition and its sharded parameter state.

    `params` is a loader's tree (unfused projections); it is fused here, once (see
    jserve.models.llama), before anything reaches a device.
    """
    params = {**params, "layers": fuse_projections(cfg, params["layers"])}
    abstract = nnx.eval_shape(lambda: LlamaModel(cfg, dtype))
    graphdef, state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(state, mesh).to_pure_dict()
    placed = jax.tree.map(lambda x, s: jax.device_put(jnp.asarray(x, dtype), s), params, shardings)
    state.replace_by_pure_dict(placed)
    return graphdef, state
