"""Frozen configuration of the scheduler and the KV cache; constructors validate, nothing else.

Defaults suit CPU serving of a ~135M-parameter model (SmolLM2-135M): a 512-token step is where
XLA's CPU matmuls reach most of their peak, and 32 sequences keep decode steps near 100 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from jserve.config.settings import documented, setting

POLICIES = ("continuous", "static")
# Order inside a lane: virtual-token-counter fair share between tenants, or arrival order.
FAIRNESS_POLICIES = ("vtc", "fcfs")
# Scheduling lanes in strict priority order, highest first (the HTTP field `lane` names one).
LANES = ("interactive", "long", "batch")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@documented
@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one iteration, and which waiting work goes first."""

    max_num_seqs: int = setting(
        32, "sequences in one step, i.e. requests running at once", vllm="--max-num-seqs"
    )
    max_num_batched_tokens: int = setting(
        512,
        "tokens computed in one step, decode tokens plus prefill chunks",
        vllm="--max-num-batched-tokens",
    )
    max_model_len: int = setting(
        2048, "longest prompt plus output of one request, in tokens", vllm="--max-model-len"
    )
    long_prefill_token_threshold: int = setting(
        0,
        "most prefill tokens one request may compute in one step; 0 = no cap but the step's",
        vllm="--long-prefill-token-threshold",
    )
    long_prompt_threshold: int = setting(
        512, "a prompt longer than this many tokens waits and runs in the 'long' lane"
    )
    long_lane_max_share: float = setting(
        0.5,
        "fraction, in (0, 1], of a step's token budget the long lane's prefill may take while "
        "other work shares the step (alone it may take the whole step)",
    )
    max_waiting_requests: int = setting(
        1024,
        "waiting-queue cap in sequences (each of a request's n samples counts); more are "
        "refused (HTTP 429, reason queue_full)",
    )
    free_block_watermark: float = setting(
        0.01,
        "fraction, in [0, 1), of KV blocks kept free: no new prefill starts below it (the high "
        "watermark is 1 minus this)",
    )
    kv_reject_watermark: float = setting(
        1.0,
        "KV usage, in (0, 1], above which new requests are refused (HTTP 503, reason kv_full); "
        "1 = never",
    )
    aging_iterations: int = setting(
        64,
        "steps a lane's oldest waiting request may wait before it goes ahead of strict lane "
        "order, so no request waits forever",
    )
    scheduling: str = setting(
        "continuous",
        "continuous (iteration-level) or static (admit a batch only when nothing runs, then run "
        "it until every member finishes: a baseline for benchmarks)",
        choices=POLICIES,
    )
    fairness: str = setting(
        "vtc",
        "order inside a lane: vtc (fair share between tenants by virtual token counters, FIFO "
        "within a tenant) or fcfs (arrival order)",
        choices=FAIRNESS_POLICIES,
    )
    deadline_admission: bool = setting(
        True,
        "refuse at arrival a request whose timeout its estimated finish time (priced from "
        "measured step costs) misses (HTTP 429, reason deadline); off, deadlines only expire",
    )
    target_itl_ms: float = setting(
        0.0,
        "inter-token latency target of running decodes, in ms: each step takes as many prefill "
        "tokens as the precompiled bucket whose measured step time fits it allows; 0 = a "
        "fixed budget of max_num_batched_tokens",
    )
    enable_chunked_prefill: bool = setting(
        True,
        "split prompts across steps; off, a prompt's prefill runs whole in one step (then "
        "max_num_batched_tokens must cover max_model_len)",
        vllm="--enable-chunked-prefill",
    )
    enable_prefix_caching: bool = setting(
        True,
        "reuse the KV blocks of identical prompt prefixes (chained full-block hashes)",
        vllm="--enable-prefix-caching",
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            _require(value >= 1, f"{name} must be >= 1, got {value}")
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}) so every running sequence can decode in each step",
        )
        _require(
            0 <= self.long_prefill_token_threshold <= self.max_num_batched_tokens,
            f"long_prefill_token_threshold must be in [0, max_num_batched_tokens="
            f"{self.max_num_batched_tokens}] (0 = no cap), got {self.long_prefill_token_threshold}",
        )
        _require(
            self.long_prompt_threshold >= 1,
            f"long_prompt_threshold must be >= 1, got {self.long_prompt_threshold}",
        )
        _require(
            0.0 < self.long_lane_max_share <= 1.0,
            f"long_lane_max_share must be in (0, 1], got {self.long_lane_max_share}",
        )
        _require(
            self.max_waiting_requests >= 1,
            f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}",
        )
        _require(
            0.0 <= self.free_block_watermark < 1.0,
            f"free_block_watermark must be in [0, 1), got {self.free_block_watermark}",
        )
        _require(
            0.0 < self.kv_reject_watermark <= 1.0,
            f"kv_reject_watermark must be in (0, 1], got {self.kv_reject_watermark}",
        )
        _require(
            self.fairness in FAIRNESS_POLICIES,
            f"fairness must be one of {FAIRNESS_POLICIES}, got {self.fairness!r}",
        )
        _require(
            self.target_itl_ms >= 0.0,
            f"target_itl_ms must be >= 0 (0 = off), got {self.target_itl_ms}",
        )
        _require(
            self.aging_iterations >= 1,
            f"aging_iterations must be >= 1, got {self.aging_iterations}",
        )
        _require(
            self.scheduling in POLICIES,
            f"scheduling must be one of {POLICIES}, got {self.scheduling!r}",
        )
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                f"without chunked prefill a whole prompt must fit in one step: "
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
                f"max_model_len ({self.max_model_len}); raise it or enable chunked prefill",
            )
            _require(
                self.target_itl_ms == 0.0,
                "target_itl_ms adapts the prefill chunk and needs enable_chunked_prefill=True",
            )
            _require(
                self.long_prefill_token_threshold == 0,
                f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) splits "
                f"prompts and needs enable_chunked_prefill=True; set it to 0",
            )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens (block 0 is the pad sink)."""

    block_size: int = 16
    num_blocks: int = 2048

    def __post_init__(self) -> None:
        _require(self.block_size >= 1, f"block_size must be >= 1, got {self.block_size}")
        _require(
            self.num_blocks >= 2,
            f"num_blocks must be >= 2 (block 0 is the padding sink), got {self.num_blocks}",
        )
