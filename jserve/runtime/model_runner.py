"""The device side of a step: the KV pool, one compiled executable per bucket, and running them.

The runner owns the (donated) KV pool and the parameters; it never decides what runs. The model
step is compiled ahead of time for every (token bucket, sequence bucket) pair at start-up and
kept keyed by that pair, so serving only ever calls finished executables.

Over a mesh (tensor parallelism) the pool is split on its KV-head axis, attention runs per
shard (jserve.layers.attention), and the step's logits are replicated so the sampler reads one
local copy on one device: sampling is never partitioned, and in a multi-process run process 0
samples alone.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from jserve.config.engine_args import AttentionImpl, KVCacheDtype
from jserve.layers.attention import HeadSharding, PagedAttentionMetadata
from jserve.models.config import ModelConfig
from jserve.models.llama import MODEL_AXIS, lay_out_weights
from jserve.pallas import choose_impl, kv_cache_shape
from jserve.pallas.kv_cache import SCALE_DTYPE, kv_pool_dtype, kv_scales_shape
from jserve.pallas.layer_matmul import MatmulImpl, choose_matmul_impl
from jserve.runtime.huge_pages import advise_huge_pages
from jserve.runtime.startup import StartupPhase, describe_bucket
from jserve.runtime.step_inputs import StepInputs

log = logging.getLogger(__name__)


def mesh_platform(mesh: jax.sharding.Mesh) -> str:
    """The platform a mesh's devices are ("cpu", "gpu", "tpu"): what its steps compile for,
    which may not be this process's default backend (jserve.aot compiles for absent chips)."""
    return mesh.devices.flat[0].platform


def projection_impl(platform: str, dtype: Any, tensor_parallel_size: int) -> MatmulImpl:
    """How the layers' projections run (jserve.pallas.layer_matmul): the native matmul is one
    device's kernel, so a sharded model keeps XLA's partitioned dot."""
    return MatmulImpl.XLA if tensor_parallel_size > 1 else choose_matmul_impl(platform, dtype)


def resolve_attn_impl(
    attn_impl: str, platform: str, dtype: Any, kv_cache_dtype: str = KVCacheDtype.AUTO
) -> str:
    """The attention implementation `attn_impl` ("auto" or a name) means on `platform` for
    pools of `kv_cache_dtype`."""
    if attn_impl == AttentionImpl.AUTO:
        return choose_impl(platform, dtype, kv_cache_dtype)
    return attn_impl


def kv_block_bytes(
    cfg: ModelConfig,
    block_size: int,
    dtype: Any,
    attn_impl: str,
    kv_cache_dtype: str = KVCacheDtype.AUTO,
) -> int:
    """Bytes one block takes across all layers, K and V (and a quantized pool's scales), in the
    layout implementation `attn_impl` (resolved, not "auto") reads."""
    two_blocks = kv_cache_shape(
        cfg.num_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim, impl=attn_impl
    )  # fmt: skip
    one_block_one_pool = math.prod(two_blocks) // 2 * kv_pool_dtype(kv_cache_dtype, dtype).itemsize
    if kv_cache_dtype != KVCacheDtype.AUTO:
        scales = kv_scales_shape(cfg.num_layers, 1, block_size, cfg.num_kv_heads)
        one_block_one_pool += math.prod(scales) * SCALE_DTYPE.itemsize
    return 2 * one_block_one_pool


class StepOutput(NamedTuple):
    """A model step's rows (`StepInputs.logits_indices`), on one device: the logits the
    sampler reads, and the final hidden states (after the final norm) pooling reads. The
    hidden states stay on the device unless a step has pooling rows."""

    logits: jax.Array  # [S, V] float32
    hidden: jax.Array  # [S, D] float32


def _model_step(
    graphdef: nnx.GraphDef,  # static: the model's structure
    state: nnx.State,  # parameters
    kv_cache: tuple[jax.Array, ...],  # (k_pool, v_pool[, k_scales, v_scales]), donated
    inputs: StepInputs,
    attn_impl: str,  # static: attention implementation name
    heads: HeadSharding | None,  # static: how heads split over the mesh (None: one device)
    matmul_impl: str,  # static: how the layers' projections run (jserve.pallas.layer_matmul)
    platform: str,  # static: the platform compiled for (kernels run natively there)
) -> tuple[StepOutput, tuple[jax.Array, jax.Array]]:
    """Returns (the logits [S, V] and final hidden states [S, D], float32, of the rows
    `inputs.logits_indices` names: each sequence's last token, a decode's drafts, an
    `every_row` chunk's tokens; the new kv_cache)."""
    model = nnx.merge(graphdef, state)
    meta = PagedAttentionMetadata(
        slot_mapping=inputs.slot_mapping,
        block_tables=inputs.block_tables,
        cu_q_lens=inputs.cu_q_lens,
        kv_lens=inputs.kv_lens,
        num_seqs=inputs.num_seqs,
        impl=attn_impl,
        heads=heads,
        platform=platform,
    )
    # Padding follows the real rows on both axes (cu_q_lens's pads hold the real token count).
    real_rows = (inputs.cu_q_lens[-1], inputs.num_logits[0])
    logits, hidden, kv_cache = model(
        inputs.token_ids,
        inputs.positions,
        kv_cache,
        meta,
        inputs.logits_indices,
        matmul_impl,
        real_rows,
    )
    if heads is not None:
        logits = _gathered_logits(logits, heads)
        replicated = jax.sharding.NamedSharding(heads.mesh, jax.sharding.PartitionSpec())
        hidden = jax.lax.with_sharding_constraint(hidden, replicated)
    return StepOutput(logits, hidden), kv_cache


def _gathered_logits(logits: jax.Array, heads: HeadSharding) -> jax.Array:
    """Each device computes its slice of the vocabulary, then the slices are gathered, so every
    device holds all logits [S, V]. Asked for replicated logits directly, XLA gathers an untied
    lm_head's weight [D, V] instead, every step."""
    spec = jax.sharding.PartitionSpec
    if logits.shape[1] % heads.mesh.shape[heads.axis] == 0:
        split = jax.sharding.NamedSharding(heads.mesh, spec(None, heads.axis))
        logits = jax.lax.with_sharding_constraint(logits, split)
    return jax.lax.with_sharding_constraint(logits, jax.sharding.NamedSharding(heads.mesh, spec()))


_model_step_jit = jax.jit(_model_step, static_argnums=(0, 4, 5, 6, 7), donate_argnums=(2,))


@dataclass(frozen=True)
class ModelStep:
    """How the model step is built and compiled on a mesh: the one description ModelRunner
    compiles and runs and jserve.aot compiles for chips this machine lacks.

    `attn_impl` is resolved for the mesh's platform (never "auto"): the KV pool's layout is that
    implementation's (`kv_cache_shape`), so the pool and the kernel cannot disagree.
    """

    cfg: ModelConfig
    graphdef: nnx.GraphDef
    mesh: jax.sharding.Mesh
    dtype: Any
    attn_impl: str
    matmul_impl: str
    kv_cache_dtype: str = KVCacheDtype.AUTO  # the pools' elements (jserve.pallas.kv_cache)

    @classmethod
    def make(
        cls,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        mesh: jax.sharding.Mesh,
        dtype: Any,
        attn_impl: str = "auto",
        kv_cache_dtype: str = KVCacheDtype.AUTO,
    ) -> ModelStep:
        platform = mesh_platform(mesh)
        matmul_impl = projection_impl(platform, dtype, mesh.shape[MODEL_AXIS])
        impl = resolve_attn_impl(attn_impl, platform, dtype, kv_cache_dtype)
        return cls(cfg, graphdef, mesh, dtype, impl, matmul_impl, kv_cache_dtype)

    @property
    def platform(self) -> str:
        return mesh_platform(self.mesh)

    @property
    def heads(self) -> HeadSharding | None:
        return HeadSharding(self.mesh, MODEL_AXIS) if self.mesh.shape[MODEL_AXIS] > 1 else None

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        cfg = self.cfg
        return kv_cache_shape(
            cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
            impl=self.attn_impl,
        )  # fmt: skip

    def kv_cache_spec(self, num_blocks: int, block_size: int) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The KV cache as the steps take it, placed on the mesh: (k_pool, v_pool), and for
        quantized pools their (k_scales, v_scales). KV heads follow the attention heads' split over
        the mesh's model axis."""
        pool = self.kv_cache_shape(num_blocks, block_size)
        parts = [(pool, kv_pool_dtype(self.kv_cache_dtype, self.dtype))] * 2
        if self.kv_cache_dtype != KVCacheDtype.AUTO:
            scales = kv_scales_shape(self.cfg.num_layers, num_blocks, block_size, pool[2])
            parts += [(scales, SCALE_DTYPE)] * 2
        return tuple(
            jax.ShapeDtypeStruct(shape, dtype, sharding=self._head_split(len(shape)))
            for shape, dtype in parts
        )

    def _head_split(self, ndim: int) -> jax.sharding.NamedSharding:
        spec = jax.sharding.PartitionSpec(None, None, MODEL_AXIS, *[None] * (ndim - 3))
        return jax.sharding.NamedSharding(self.mesh, spec)

    def kv_cache_init(self, num_blocks: int, block_size: int) -> Any:
        """The jitted function making a zero KV cache (`kv_cache_spec`), placed on the mesh."""
        spec = self.kv_cache_spec(num_blocks, block_size)
        return jax.jit(
            lambda: tuple(jnp.zeros(x.shape, x.dtype) for x in spec),
            out_shardings=tuple(x.sharding for x in spec),
        )

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where the step's logits are read (the sampler must expect the same): this process's
        first device of the mesh, which holds a full copy."""
        return jax.sharding.SingleDeviceSharding(self.mesh.local_devices[0])

    def lower(self, state: Any, kv_cache: Any, inputs: StepInputs) -> jax.stages.Lowered:
        """The model step of `inputs`'s bucket, lowered (arrays or ShapeDtypeStructs)."""
        return _model_step_jit.lower(
            self.graphdef, state, kv_cache, inputs, self.attn_impl, self.heads, self.matmul_impl,
            self.platform,
        )  # fmt: skip


class ModelRunner:
    def __init__(
        self,
        cfg: ModelConfig,
        graphdef: nnx.GraphDef,
        state: nnx.State,
        mesh: jax.sharding.Mesh,
        *,
        num_blocks: int,
        block_size: int,
        dtype: Any,
        attn_impl: str = "auto",
        kv_cache_dtype: str = KVCacheDtype.AUTO,
    ) -> None:
        self.cfg = cfg
        self.step = ModelStep.make(cfg, graphdef, mesh, dtype, attn_impl, kv_cache_dtype)
        self.mesh = mesh
        self.state = lay_out_weights(state, self.step.matmul_impl)
        self._zeros = self.step.kv_cache_init(num_blocks, block_size)
        self.reset_kv_cache()
        self._executables: dict[tuple[int, int], Any] = {}

    @property
    def matmul_impl(self) -> str:
        return self.step.matmul_impl

    def reset_kv_cache(self) -> None:
        """A fresh (zero) KV pool, e.g. after a failed step consumed the donated one. Steps
        donate it and get it back in the same buffers, so its huge pages (asked for here)
        last."""
        self.kv_cache = self._zeros()
        advise_huge_pages(self.kv_cache)

    def precompile(
        self, example_inputs: Callable[[int, int], StepInputs], pairs: list[tuple[int, int]]
    ) -> float:
        """Compile the model step for each (tokens, seqs) bucket pair, logging each one
        (jserve.runtime.startup); returns seconds taken."""
        with StartupPhase("model step", len(pairs)) as phase:
            for t, s in phase.each(pairs, describe_bucket):
                lowered = self.step.lower(self.state, self.kv_cache, example_inputs(t, s))
                self._executables[(t, s)] = lowered.compile()
        return phase.seconds

    @property
    def logits_sharding(self) -> jax.sharding.Sharding:
        """Where `run`'s logits live (the sampler must expect the same)."""
        return self.step.logits_sharding

    def hlo_text(self, tokens: int, seqs: int) -> str:
        """The optimized HLO of a bucket's executable: what a profile's op names refer to."""
        return self._executables[(tokens, seqs)].as_text()

    def run(self, inputs: StepInputs) -> StepOutput:
        """Run one step; returns its rows' logits [S, V] and hidden states [S, D] (on one
        device) and keeps the new KV pool."""
        exe = self._executables.get((inputs.num_tokens, inputs.max_seqs))
        if exe is None:
            raise RuntimeError(
                f"no executable for bucket (tokens={inputs.num_tokens}, seqs={inputs.max_seqs}); "
                f"precompiled: {sorted(self._executables)}"
            )
        out, self.kv_cache = exe(self.state, self.kv_cache, inputs)
        return StepOutput(out.logits.addressable_data(0), out.hidden.addressable_data(0))
