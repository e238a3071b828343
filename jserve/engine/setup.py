"""Everything an LLMEngine needs before its first step, built from EngineArgs.

Model load (through the conversion cache), the device mesh and parameter placement, the KV
pool's size in blocks, the scheduler with its settings taken from EngineArgs by field name, the
step buckets, the input builder, the model runner and the sampler. The engine's own module is
then only the step loop and request bookkeeping.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax

from jserve.config.cache_dir import default_cache_dir
from jserve.config.engine_args import EngineArgs, KVCacheDtype, Quantization
from jserve.config.scheduler import CacheConfig
from jserve.core.buckets import engine_buckets, step_buckets
from jserve.core.scheduler import Scheduler
from jserve.core.step_costs import StepCosts, check_target_itl, load_bucket_report
from jserve.core.tenants import load_tenant_policy
from jserve.loaders.chat_template import load_chat_template
from jserve.loaders.model_source import (
    NO_QUANTIZATION,
    LoadedModel,
    default_model_path,
    load_model,
)
from jserve.loaders.tokenizer import Tokenizer
from jserve.models.awq import awq_params
from jserve.models.calibration import CALIBRATION_TEXT, calibration_windows
from jserve.models.config import ModelConfig
from jserve.models.int8_weights import int8_params
from jserve.pallas.kv_cache import kv_pool_dtype
from jserve.pallas.layer_matmul import MatmulImpl
from jserve.pallas.native_build import load as load_native_kernels
from jserve.pallas.ragged_common import quantized_kv_impls
from jserve.runtime import multihost
from jserve.runtime.compilation import enable_persistent_cache
from jserve.runtime.model_runner import (
    ModelRunner,
    kv_block_bytes,
    projection_impl,
    resolve_attn_impl,
)
from jserve.runtime.params import check_tensor_parallel, make_mesh, place_model, resolve_dtype
from jserve.runtime.sampler import Sampler
from jserve.runtime.startup import StartupPhase, describe_bucket
from jserve.runtime.step_inputs import StepInputBuilder

log = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class StepShapes:
    """What the engine compiles and allocates for, decided from EngineArgs, the model and the
    platform its mesh is (jserve.aot asks the same for chips this machine lacks)."""

    dtype: Any
    attn_impl: str  # resolved for the platform: the KV pool is laid out for it
    max_model_len: int
    block_bytes: int  # one KV block across all layers, K and V, on all devices together
    num_blocks: int
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """Every (token bucket, sequence bucket) step shape: the set to precompile."""
        return step_buckets(self.token_buckets, self.seq_buckets)

    def input_builder(self, block_size: int) -> StepInputBuilder:
        max_blocks = math.ceil(self.max_model_len / block_size)
        return StepInputBuilder(self.token_buckets, self.seq_buckets, block_size, max_blocks)

    def sampler(self, vocab_size: int) -> Sampler:
        """The sampler, one executable per sequence bucket a step can have."""
        return Sampler(vocab_size, sorted({s for _, s in self.pairs}), self.max_model_len)


def step_shapes(args: EngineArgs, cfg: ModelConfig, platform: str) -> StepShapes:
    """The dtype, attention implementation, KV pool size and buckets `args` mean for model
    `cfg` on a mesh of `platform` devices; raises ValueError for a split the model refuses."""
    dtype = resolve_dtype(args.dtype, platform)
    check_tensor_parallel(cfg, args.tensor_parallel_size)
    attn_impl = resolve_attn_impl(args.attention_impl, platform, dtype, args.kv_cache_dtype)
    check_kv_cache_dtype(args.kv_cache_dtype, attn_impl, platform)
    max_model_len = args.max_model_len or min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)
    block_bytes = kv_block_bytes(cfg, args.block_size, dtype, attn_impl, args.kv_cache_dtype)
    num_blocks = args.num_kv_blocks or args.kv_cache_memory // block_bytes
    # On CPU a step's cost grows with its tokens from about 16 on, so decode sizes get midpoints.
    token_buckets, seq_buckets = engine_buckets(
        args.max_num_batched_tokens, args.max_num_seqs, platform == "cpu"
    )
    return StepShapes(
        dtype, attn_impl, max_model_len, block_bytes, num_blocks, token_buckets, seq_buckets
    )


def check_kv_cache_dtype(kv_cache_dtype: str, attn_impl: str, platform: str) -> None:
    """Quantized pools need an attention implementation that reads them (a ValueError naming
    the ones that do otherwise; AUTO picks one of them), and float8 ones a GPU: the CPU and the
    TPUs jserve targets (v5e and its kin) have no float8 storage, and int8 serves the same
    bytes there."""
    if kv_cache_dtype == KVCacheDtype.AUTO:
        return
    float8 = kv_cache_dtype != KVCacheDtype.INT8  # every other quantized name is a float8
    if float8 and platform not in ("gpu", "cuda"):
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} stores float8, which runs on GPU (NVIDIA "
            f"Hopper: H100, H200); {platform} has no float8 storage: use --kv-cache-dtype int8 "
            "(the same bytes per element and scales, on every backend)"
        )
    readers = quantized_kv_impls(kv_cache_dtype)
    if attn_impl not in readers:
        names = ", ".join(readers)
        raise ValueError(
            f"--kv-cache-dtype {kv_cache_dtype} is read by --attention-impl {names} (auto picks "
            f"one); {attn_impl} reads pools of the model's dtype only"
        )


def compilation_cache_dir(args: EngineArgs) -> str:
    """Where the engine keeps (and `jserve compile --cache-dir` writes) compiled executables."""
    return args.compilation_cache_dir or f"{args.cache_dir or default_cache_dir()}/xla"


def packs_quantized_blocks(args: EngineArgs, platform: str) -> bool:
    """Whether `args` serve a GGUF's quantized blocks packed on `platform`: --quantization auto
    where the native CPU kernel runs the projections (float32, one device). Elsewhere XLA runs
    the dequantized weights (a quantized path for TPU and GPU is later work)."""
    if args.quantization != Quantization.AUTO:
        return False
    return runs_native(args, platform)


def runs_native(args: EngineArgs, platform: str) -> bool:
    """Whether the native CPU kernel runs the projections of `args` on `platform`."""
    dtype = resolve_dtype(args.dtype, platform)
    return projection_impl(platform, dtype, args.tensor_parallel_size) == MatmulImpl.NATIVE


def quantized_to_int8(loaded: LoadedModel, native: bool, model: Path | None = None) -> LoadedModel:
    """--quantization int8: `loaded` (read from `model`, default: its source) with its matmul
    weights int8 (jserve.models.int8_weights) after activation-aware scaling
    (jserve.models.awq), packed for the native CPU kernel if `native`. A
    GGUF is refused: its weights are quantized already, and its blocks served as they are
    (auto) are smaller and exact."""
    model = model or loaded.source
    if model.suffix == ".gguf" or loaded.quantization != NO_QUANTIZATION:
        raise ValueError(
            f"--quantization int8 quantizes the float weights of a safetensors or jserve "
            f"checkpoint; {model.name} holds quantized weights already: serve them with "
            "--quantization auto (or none)"
        )
    started = time.perf_counter()
    ids = loaded.tokenizer.encode(CALIBRATION_TEXT.read_text())
    windows = calibration_windows(ids, loaded.config.vocab_size)
    params = awq_params(loaded.config, loaded.params, windows)
    log.info(
        "--quantization int8: activation-aware scales (AWQ) calibrated on %d tokens of %s "
        "in %.1f s",
        windows.size, CALIBRATION_TEXT.name, time.perf_counter() - started,
    )  # fmt: skip
    params = int8_params(loaded.config, params, packed=native)
    return dataclasses.replace(loaded, params=params)


@dataclass
class EngineParts:
    model_name: str
    quantization: str  # the weights as served: "none", or "gguf:" and their block formats
    kv_cache_dtype: str  # the KV pool's elements' dtype name: the model's, int8, float8_e4m3fn...
    tokenizer: Tokenizer
    model_config: ModelConfig
    max_model_len: int
    scheduler: Scheduler
    bucket_pairs: list[tuple[int, int]]  # every (token bucket, sequence bucket) step shape
    inputs_builder: StepInputBuilder
    runner: ModelRunner
    sampler: Sampler


def _model_as_served(
    args: EngineArgs, loaded: LoadedModel | None, cache_dir: str, platform: str
) -> tuple[LoadedModel, Tokenizer]:
    """The model (`loaded`, else read from args.model) as --quantization serves it, and the
    tokenizer with --chat-template's template."""
    # --chat-template, read (and a bad one refused) before the model loads.
    template = None if args.chat_template is None else load_chat_template(args.chat_template)
    given = loaded is not None
    packed = packs_quantized_blocks(args, platform)
    loaded = loaded or load_model(args.model, cache_dir=cache_dir, packed=packed)
    if args.quantization == Quantization.INT8:  # (a cached GGUF's source is its cache entry)
        model = None if given else Path(args.model) if args.model else default_model_path()
        loaded = quantized_to_int8(loaded, runs_native(args, platform), model)
    tokenizer = loaded.tokenizer
    if template is not None:  # on a copy: `loaded` may be shared (tests, LLM)
        tokenizer = copy.copy(tokenizer)
        tokenizer.chat_template = template
    return loaded, tokenizer


def build_engine_parts(args: EngineArgs, loaded: LoadedModel | None = None) -> EngineParts:
    """Load (or take `loaded`), place and size everything; compiles nothing yet."""
    multihost.initialize(args.coordinator_address, args.num_processes, args.process_id)
    cache_dir = args.cache_dir or default_cache_dir()
    enable_persistent_cache(compilation_cache_dir(args))
    if jax.default_backend() == "cpu":  # before the runner picks its kernels: built in cache_dir
        load_native_kernels(cache_dir)
    platform = jax.devices()[0].platform  # the mesh's devices'
    loaded, tokenizer = _model_as_served(args, loaded, cache_dir, platform)
    cfg = loaded.config
    shapes = step_shapes(args, cfg, platform)
    int8 = args.quantization == Quantization.INT8
    if args.num_processes > 1 and args.tensor_parallel_size != jax.device_count():
        raise ValueError(
            f"a run of {args.num_processes} processes has {jax.device_count()} devices in all; "
            f"set --tensor-parallel-size {jax.device_count()} (got {args.tensor_parallel_size})"
        )
    mesh = make_mesh(args.tensor_parallel_size)
    int8_xla = int8 and not runs_native(args, platform)  # int8 arrays and scales: XLA's dot
    graphdef, state = place_model(cfg, loaded.params, shapes.dtype, mesh, int8_xla)
    max_model_len = shapes.max_model_len
    num_blocks = pool_blocks(args, shapes, weight_bytes(state), _device_bytes(mesh))
    token_buckets, seq_buckets, pairs = shapes.token_buckets, shapes.seq_buckets, shapes.pairs
    seed = load_bucket_report(args.step_costs_file) if args.step_costs_file else None
    scheduler = Scheduler(
        args.scheduler_config(max_model_len),
        CacheConfig(block_size=args.block_size, num_blocks=num_blocks),
        load_tenant_policy(args.tenants_file),
        StepCosts(token_buckets, seq_buckets, seed),
    )
    inputs_builder = shapes.input_builder(args.block_size)
    # Process 0 of a multi-process run announces each step to the others (runtime.multihost).
    leads = args.num_processes > 1 and args.process_id == 0
    runner = (multihost.LeaderRunner if leads else ModelRunner)(
        cfg, graphdef, state, mesh, num_blocks=num_blocks, block_size=args.block_size,
        dtype=shapes.dtype, attn_impl=shapes.attn_impl, kv_cache_dtype=args.kv_cache_dtype,
    )  # fmt: skip
    sampler = shapes.sampler(cfg.vocab_size)
    log.info(
        "model %s: weights %s (%.0f MiB), %d KV blocks of %d tokens, kv_cache_dtype %s (%.0f "
        "MiB), token buckets %s, seq buckets %s", loaded.name, loaded.quantization,
        weight_bytes(runner.state) / 2**20, num_blocks, args.block_size, args.kv_cache_dtype,
        num_blocks * shapes.block_bytes / 2**20, token_buckets, seq_buckets,
    )  # fmt: skip
    return EngineParts(
        loaded.name, loaded.quantization, kv_pool_dtype(args.kv_cache_dtype, shapes.dtype).name,
        tokenizer, cfg, max_model_len, scheduler, pairs, inputs_builder, runner, sampler,
    )  # fmt: skip


def pool_blocks(
    args: EngineArgs, shapes: StepShapes, weights: int, device_bytes: int | None
) -> int:
    """KV blocks of the pool: --num-kv-blocks, else the share of memory
    --gpu-memory-utilization gives it (on devices of `device_bytes` in all, what `weights`
    bytes of weights leave of that fraction; on CPU, where `device_bytes` is None, that
    fraction of --kv-cache-memory), else --kv-cache-memory's worth (`shapes.num_blocks`)."""
    fraction = args.gpu_memory_utilization
    if args.num_kv_blocks or fraction is None:
        return shapes.num_blocks
    if device_bytes is None:
        pool = fraction * args.kv_cache_memory
    else:
        pool = fraction * device_bytes - weights
    if pool < 2 * shapes.block_bytes:  # one block is the padding sink
        raise ValueError(
            f"--gpu-memory-utilization {fraction:g} leaves {max(0, int(pool))} bytes for the KV "
            f"pool (weights take {weights}), less than two blocks of {shapes.block_bytes}; "
            "raise it or lower --block-size"
        )
    return int(pool) // shapes.block_bytes


def _device_bytes(mesh: Any) -> int | None:
    """Memory JAX's allocator may use on the mesh's devices together (each as much as this
    process's first); None on CPU, or where the device reports no limit."""
    device = next(d for d in mesh.devices.flat if d.process_index == jax.process_index())
    if device.platform == "cpu":
        return None
    limit = (device.memory_stats() or {}).get("bytes_limit")
    return None if limit is None else limit * mesh.devices.size


def weight_bytes(state: Any) -> int:
    """Bytes of a model's parameters (each array's whole size, counted once)."""
    return sum(leaf.nbytes for leaf in jax.tree.leaves(state))


def measure_step_costs(
    scheduler: Scheduler,
    runner: ModelRunner,
    inputs_builder: StepInputBuilder,
    pairs: list[tuple[int, int]],
) -> None:
    """With `target_itl_ms` set, make sure every bucket's step time is known before serving
    (time one warm step of each unless a report seeded them), then check the target is
    reachable: a target no step can meet is a start-up error, not a silent no-op."""
    config, costs = scheduler.config, scheduler.step_costs
    if not config.target_itl_ms or costs is None:
        return
    if not costs.seconds:
        with StartupPhase("step costs for target_itl_ms", len(pairs)) as phase:
            for tokens, seqs in phase.each(pairs, describe_bucket):
                start = time.perf_counter()
                jax.block_until_ready(runner.run(inputs_builder.example(tokens, seqs)))
                costs.seconds[(tokens, seqs)] = time.perf_counter() - start
    check_target_itl(config.target_itl_ms, costs)
