"""Put a model's parameters on devices: dtype choice, the mesh, and sharded placement."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.config.engine_args import Dtype
from jserve.models.config import ModelConfig
from jserve.models.llama import MODEL_AXIS, LlamaModel, fuse_projections
from jserve.pallas.layer_matmul import is_packed_blocks

DTYPES = {Dtype.FLOAT32: jnp.float32, Dtype.BFLOAT16: jnp.bfloat16, Dtype.FLOAT16: jnp.float16}


def resolve_dtype(name: Dtype | str | None, platform: str | None = None) -> Any:
    """The dtype `name` (a Dtype or its name) stands for on `platform` (default:
    jax.default_backend()). AUTO (or None) is float32 on CPU, where XLA's bfloat16 arithmetic is
    slower than float32's unless the CPU has AVX512-BF16, and bfloat16 on GPU/TPU."""
    if name is None or name == Dtype.AUTO:
        return jnp.float32 if (platform or jax.default_backend()) == "cpu" else jnp.bfloat16
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {[str(d) for d in Dtype]}, got {name!r}")
    return DTYPES[name]


def make_mesh(
    tensor_parallel_size: int = 1, devices: Sequence[jax.Device] | None = None
) -> jax.sharding.Mesh:
    """A 1-D mesh over the first `tensor_parallel_size` of `devices` (default: jax.devices();
    jserve.aot passes a topology's compile-only devices), axis "model"."""
    devices = jax.devices() if devices is None else list(devices)
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


def check_tensor_parallel(cfg: ModelConfig, tensor_parallel_size: int) -> None:
    """Raise ValueError naming every count the model's split over `tensor_parallel_size`
    devices needs to divide: query and KV heads (attention runs per KV-head shard), MLP hidden
    units, and the vocabulary when the lm_head is its own (column-parallel) weight."""
    n = tensor_parallel_size
    counts = {
        "query heads": cfg.num_heads,
        "KV heads": cfg.num_kv_heads,
        "MLP hidden units (intermediate_size)": cfg.intermediate_size,
    }
    if not cfg.tie_word_embeddings:
        counts["vocabulary entries (untied lm_head)"] = cfg.vocab_size
    bad = [f"{count} {name}" for name, count in counts.items() if count % n]
    if bad:
        fits = [
            d for d in range(1, cfg.num_kv_heads + 1) if all(c % d == 0 for c in counts.values())
        ]
        raise ValueError(
            f"tensor_parallel_size={n} must divide the model's head counts "
            f"({cfg.num_heads} query heads, {cfg.num_kv_heads} KV heads) and its other split "
            f"axes; it does not divide {', '.join(bad)}. Sizes that fit this model: {fits}"
        )


def abstract_model(
    cfg: ModelConfig, dtype: Any, mesh: jax.sharding.Mesh, int8_weights: bool = False
) -> tuple[nnx.GraphDef, nnx.State]:
    """The model's static graph definition and its parameters as ShapeDtypeStructs carrying
    their shardings on `mesh`: every shape and placement, no weights. `place_model` fills it;
    jserve.aot compiles from it. `int8_weights`: the "xla" layout of --quantization int8
    (jserve.models.int8_weights)."""
    abstract = nnx.eval_shape(lambda: LlamaModel(cfg, dtype, int8_weights))
    graphdef, state = nnx.split(abstract)
    shardings = nnx.get_named_sharding(state, mesh)
    state = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings
    )
    return graphdef, state


def place_model(
    cfg: ModelConfig, params: Any, dtype: Any, mesh: jax.sharding.Mesh, int8_weights: bool = False
) -> tuple[nnx.GraphDef, nnx.State]:
    """Split the model once: a static graph definition and its sharded parameter state.

    `params` is a loader's tree (unfused projections); it is fused here, once (see
    jserve.models.llama), before anything reaches a device. Packed GGUF blocks (uint8 arrays,
    jserve.pallas.quant_blocks: fused already) are placed as they are, whole on each device;
    only the native CPU kernel of an unsplit model reads them. With `int8_weights`, `params`
    holds int8 weights and their scales (jserve.models.int8_weights' "xla" layout).
    """
    params = {**params, "layers": fuse_projections(cfg, params["layers"])}
    graphdef, state = abstract_model(cfg, dtype, mesh, int8_weights)
    whole = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())

    def put(x: Any, abstract: jax.ShapeDtypeStruct) -> jax.Array:
        if is_packed_blocks(x):
            return jax.device_put(x, whole)
        return jax.device_put(jnp.asarray(x, abstract.dtype), abstract.sharding)

    state.replace_by_pure_dict(jax.tree.map(put, params, state.to_pure_dict()))
    return graphdef, state
