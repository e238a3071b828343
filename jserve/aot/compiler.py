"""Compile every executable the engine would run, for a target, from the model's config alone.

The engine's own set-up decides what is compiled: `step_shapes` (dtype, attention
implementation, KV pool size, buckets), `ModelStep` (the step function, its shardings, the
pool's layout and its zero-initialisation), the weights' layout (CPU's native matmul packs
them at load time) and the sampler, each given the target's mesh instead of this machine's.
Parameters are ShapeDtypeStructs (`abstract_model`): no weights are read or allocated. Each
executable is lowered exactly as the engine lowers it, so with a cache directory a server
with the same flags loads what this writes (jserve.aot.cache).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jserve.aot.cache import CompilationCache
from jserve.aot.costs import KERNEL_IMPLS, Cost, attention_cost, loop_corrected_cost
from jserve.aot.report import ExecutableReport, MemoryFit, Report, memory_per_chip
from jserve.aot.targets import Target
from jserve.config.engine_args import EngineArgs, Quantization
from jserve.engine.setup import StepShapes, step_shapes
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import packed_int8_bytes
from jserve.models.llama import pack_weights, weights_to_pack, with_packed_weights
from jserve.pallas.layer_matmul import MatmulImpl
from jserve.runtime.model_runner import ModelStep, projection_impl
from jserve.runtime.params import abstract_model, make_mesh


def check_split(tensor_parallel_size: int, target: Target) -> None:
    """The model is split over the first `tensor_parallel_size` devices: that many must divide
    the target's devices (one mesh axis over whole groups of chips)."""
    n = len(target.devices)
    if not 1 <= tensor_parallel_size <= n or n % tensor_parallel_size:
        fits = [d for d in range(1, n + 1) if n % d == 0]
        raise ValueError(
            f"--tensor-parallel-size {tensor_parallel_size} must divide the {n} devices of "
            f"{target.name}; sizes that fit: {fits}"
        )


def _pool_bytes(args: EngineArgs, target: Target, kv_cache_fraction: float | None) -> EngineArgs:
    """`args` with the KV pool sized as `kv_cache_fraction` of each chip's HBM, if given."""
    if kv_cache_fraction is None:
        return args
    if target.chip is None or not 0 < kv_cache_fraction < 1:
        raise ValueError(
            f"--kv-cache-fraction must be in (0, 1) and needs a chip with known HBM; got "
            f"{kv_cache_fraction} for {target.name}"
        )
    per_device = kv_cache_fraction * target.chip.hbm_bytes * target.num_chips / len(target.devices)
    total = int(per_device * args.tensor_parallel_size)
    return dataclasses.replace(args, kv_cache_memory=total, num_kv_blocks=None)


@dataclass(frozen=True)
class _Job:
    """What every executable of one `compile_engine` call is compiled for, and where it goes."""

    step: ModelStep
    shapes: StepShapes
    args: EngineArgs
    target: Target
    cache: CompilationCache | None

    def measure(self, name: str, compile_fn: Callable[[], Any]) -> tuple[Any, ExecutableReport]:
        """Compile one executable; a failure is reported (error set), not raised."""
        before = None if self.cache is None else self.cache.state()
        start = time.perf_counter()
        try:
            compiled = compile_fn()
        except Exception as e:  # a compiler's refusal belongs in the report
            seconds = time.perf_counter() - start
            error = f"{type(e).__name__}: {e}"
            return None, ExecutableReport(name, compile_s=seconds, error=error)
        seconds = time.perf_counter() - start
        mem = compiled.memory_analysis()
        row = ExecutableReport(
            name,
            compile_s=seconds,
            argument_bytes=mem.argument_size_in_bytes,
            output_bytes=mem.output_size_in_bytes,
            alias_bytes=mem.alias_size_in_bytes,
            temp_bytes=mem.temp_size_in_bytes,
            code_bytes=mem.generated_code_size_in_bytes,
        )
        if self.cache is not None and before is not None:
            row.cache, row.cache_entry = self.cache.since(before)
        return compiled, row

    def with_cost(self, row: ExecutableReport, cost: Cost, kernel: Cost) -> None:
        row.flops, row.bytes = cost.flops, cost.bytes
        row.attention_flops, row.attention_bytes = kernel.flops, kernel.bytes
        chip = self.target.chip
        if chip is not None:
            per_device = self.target.num_chips / len(self.target.devices)
            total = cost + kernel
            row.roofline_ms = 1e3 * max(
                total.flops / (chip.peak_flops * per_device),
                total.bytes / (chip.hbm_bandwidth * per_device),
            )

    def kv_cache(self) -> tuple[jax.ShapeDtypeStruct, ...]:
        """The KV cache (the K and V pools, and quantized pools' scales) as the engine allocates it
        on the mesh."""
        return self.step.kv_cache_spec(self.shapes.num_blocks, self.args.block_size)


def _int8(job: _Job) -> bool:
    return job.args.quantization == Quantization.INT8


def _laid_out_state(job: _Job) -> tuple[Any, list[ExecutableReport]]:
    """The parameters as the steps take them, and the row of the executable that lays them
    out at load time (`pack_weights`: CPU's native matmul; none for XLA's dot, nor for int8
    weights, which come packed from the load: jserve.models.int8_weights)."""
    step = job.step
    native = step.matmul_impl == MatmulImpl.NATIVE
    _, state = abstract_model(step.cfg, step.dtype, step.mesh, _int8(job) and not native)
    if not native:  # lay_out_weights leaves it as it is
        return state, []
    if _int8(job):
        whole = jax.sharding.NamedSharding(step.mesh, jax.sharding.PartitionSpec())
        packed = {
            name: jax.ShapeDtypeStruct((size,), jax.numpy.uint8, sharding=whole)
            for name, size in packed_int8_bytes(step.cfg).items()
        }
        state = with_packed_weights(state, packed)
    weights = weights_to_pack(state)
    if not weights:  # lay_out_weights has nothing to pack
        return state, []
    compiled, row = job.measure(
        "weight layout", lambda: pack_weights.lower(weights, step.matmul_impl).compile()
    )
    if compiled is None:
        return state, [row]
    # The packed weights carry the shardings XLA gives them, as the engine's do: a step lowered
    # for other shardings would be another program (and miss the compilation cache).
    packed = {
        name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        for name, x in compiled.out_info.items()
    }
    return with_packed_weights(state, packed), [row]


def _compile_steps(job: _Job, state: Any, pairs: list[tuple[int, int]]) -> list[ExecutableReport]:
    """The model step of each (tokens, seqs) bucket in `pairs`, as ModelRunner.precompile
    compiles it."""
    step, shapes, args = job.step, job.shapes, job.args
    cfg, kv_cache = step.cfg, job.kv_cache()
    builder = shapes.input_builder(args.block_size)
    itemsize = jax.numpy.dtype(kv_cache[0].dtype).itemsize  # of a pool's elements
    rows = []
    for tokens, seqs in pairs:
        kind = "decode" if tokens == seqs else "mixed"
        compiled, row = job.measure(
            f"{kind} step",
            lambda t=tokens, s=seqs: step.lower(state, kv_cache, builder.example(t, s)).compile(),
        )
        row.tokens, row.seqs = tokens, seqs
        if compiled is not None:
            kernel = Cost(0.0, 0.0)
            if step.attn_impl in KERNEL_IMPLS:
                shards = args.tensor_parallel_size
                context = shapes.max_model_len
                kernel = attention_cost(cfg, tokens, seqs, context, itemsize, shards)
            cost = loop_corrected_cost(compiled, cfg.num_layers, kv_cache[0])
            job.with_cost(row, cost, kernel)
        rows.append(row)
    return rows


def _compile_rest(job: _Job) -> list[ExecutableReport]:
    """The KV pool's zero-initialisation and the sampler's executables."""
    step, shapes = job.step, job.shapes
    init = step.kv_cache_init(shapes.num_blocks, job.args.block_size)
    _, pool_row = job.measure("kv pool init", lambda: init.lower().compile())
    rows = [pool_row]
    sampler = shapes.sampler(step.cfg.vocab_size)
    for seqs in sampler.builder.seq_buckets:
        lowered = functools.partial(sampler.lower, seqs, step.logits_sharding)
        compiled, row = job.measure("sample", lambda lowered=lowered: lowered().compile())
        row.seqs = seqs
        if compiled is not None:
            job.with_cost(row, loop_corrected_cost(compiled, 0), Cost(0.0, 0.0))
        rows.append(row)
    return rows


def compile_engine(
    args: EngineArgs,
    cfg: ModelConfig,
    model_name: str,
    target: Target,
    kv_cache_fraction: float | None = None,
    steps: list[tuple[int, int]] | None = None,
    cache_dir: str | Path | None = None,
) -> Report:
    """Compile what an engine started with `args` for model `cfg` on `target` would, and
    report each executable and the memory of each chip. With `steps`, only the model step of
    those (tokens, seqs) buckets (a quick check; code and scratch then cover only them). With
    `cache_dir`, every executable is also written to JAX's persistent compilation cache there
    (jserve.aot.cache; for the rest of this process). Raises ValueError for a split, a pool, a
    bucket or a model the engine would refuse; compiler errors go in the report."""
    check_split(args.tensor_parallel_size, target)
    args = _pool_bytes(args, target, kv_cache_fraction)
    mesh = make_mesh(args.tensor_parallel_size, target.devices)
    shapes = step_shapes(args, cfg, target.devices[0].platform)
    if shapes.num_blocks < 2:
        raise ValueError(
            f"a KV pool of {args.kv_cache_memory} bytes holds {shapes.num_blocks} blocks of "
            f"{shapes.block_bytes} bytes; it needs at least 2 (block 0 is the sink)"
        )
    unknown = sorted(set(steps or ()) - set(shapes.pairs))
    if unknown:
        raise ValueError(f"no step bucket {unknown} in this engine's buckets {shapes.pairs}")
    impl = projection_impl(target.devices[0].platform, shapes.dtype, args.tensor_parallel_size)
    int8_xla = args.quantization == Quantization.INT8 and impl == MatmulImpl.XLA
    graphdef, _ = abstract_model(cfg, shapes.dtype, mesh, int8_xla)
    step = ModelStep.make(cfg, graphdef, mesh, shapes.dtype, shapes.attn_impl, args.kv_cache_dtype)
    cache = None if cache_dir is None else CompilationCache(cache_dir)
    job = _Job(step, shapes, args, target, cache)
    # No context mesh, as in the engine: the steps carry their shardings, the sampler runs on one
    # device of the mesh.
    state, rows = _laid_out_state(job)
    rows += _compile_steps(job, state, steps or shapes.pairs)
    if steps is None:
        rows += _compile_rest(job)
    weights = sum(_shard_bytes(x) for x in jax.tree.leaves(state))
    pool_bytes = sum(_shard_bytes(x) for x in job.kv_cache())
    memory = memory_per_chip(rows, weights, pool_bytes, target, args, shapes, cfg)
    return _report(job, model_name, rows, memory)


def _report(job: _Job, model_name: str, rows: list[ExecutableReport], memory: MemoryFit) -> Report:
    args, shapes = job.args, job.shapes
    dtype = jax.numpy.dtype(shapes.dtype).name
    # The flags that decide what an engine compiles: with them, `jserve serve` runs (or loads
    # from the compilation cache) exactly these executables.
    quantization = Quantization.INT8 if _int8(job) else Quantization.NONE
    serve_flags = (
        f"--dtype {dtype} --quantization {quantization} --attention-impl {shapes.attn_impl} "
        f"--tensor-parallel-size {args.tensor_parallel_size} --max-num-seqs {args.max_num_seqs} "
        f"--max-num-batched-tokens {args.max_num_batched_tokens} --max-model-len "
        f"{shapes.max_model_len} --block-size {args.block_size} --num-kv-blocks {shapes.num_blocks}"
        f" --kv-cache-dtype {args.kv_cache_dtype}"
    )
    return Report(
        model=model_name,
        target=job.target.name,
        chip=job.target.chip,
        dtype=dtype,
        kv_cache_dtype=str(args.kv_cache_dtype),
        quantization=str(quantization),
        attention_impl=shapes.attn_impl,
        tensor_parallel_size=args.tensor_parallel_size,
        max_model_len=shapes.max_model_len,
        block_size=args.block_size,
        num_blocks=shapes.num_blocks,
        token_buckets=list(shapes.token_buckets),
        seq_buckets=list(shapes.seq_buckets),
        executables=rows,
        memory=memory,
        serve_flags=serve_flags,
        compilation_cache_dir=None if job.cache is None else str(job.cache.directory),
    )


def _shard_bytes(x: jax.ShapeDtypeStruct) -> int:
    """Bytes of one device's shard of a parameter."""
    shape = x.sharding.shard_shape(x.shape) if x.sharding is not None else x.shape
    return math.prod(shape) * jax.numpy.dtype(x.dtype).itemsize
