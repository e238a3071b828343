"""Frozen configuration of the scheduler and the KV cache; constructors validate, nothing else.

Defaults suit CPU serving of a ~135M-parameter model (SmolLM2-135M): a 512-token step is where
XLA's CPU matmuls reach most of their peak, and 32 sequences keep decode steps near 100 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("continuous", "static")
# Scheduling lanes in strict priority order, highest first (the HTTP field `lane` names one).
LANES = ("interactive", "long", "batch")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one iteration, and which waiting work goes first.

    Attributes:
        max_num_seqs: sequences in one step (running requests at once).
        max_num_batched_tokens: tokens computed in one step (decode tokens + prefill chunks).
        max_model_len: prompt plus generated tokens of one request.
        long_prefill_token_threshold: most prefill tokens one request may take in one step;
            0 = no cap beyond the step budget (vLLM's convention).
        long_prompt_threshold: a prompt longer than this lands in the "long" lane by itself.
        long_lane_max_share: fraction of the step's token budget the long lane's prefill may take
            while other work shares the step (a long prompt alone may use the whole step).
        max_waiting_requests: waiting-queue cap; overflow is rejected with reason "queue_full".
        free_block_watermark: fraction of KV blocks kept free; no new prefill starts below it.
        aging_iterations: a waiting request that waited this many iterations jumps ahead of the
            strict lane priority, so no request waits forever.
        scheduling: "continuous" (iteration-level) or "static" (admit a batch only when nothing
            runs, then run it until every member finishes; a baseline for benchmarks).
        enable_chunked_prefill: split prompts across steps; off = a prompt's prefill runs whole
            in one step or not at all (then max_num_batched_tokens must cover max_model_len, and
            the long lane's share cap cannot apply because it cannot split a prompt).
        enable_prefix_caching: reuse KV blocks of identical prefixes (chained block hashes).
    """

    max_num_seqs: int = 32
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    long_prefill_token_threshold: int = 0
    long_prompt_threshold: int = 512
    long_lane_max_share: float = 0.5
    max_waiting_requests: int = 1024
    free_block_watermark: float = 0.01
    aging_iterations: int = 64
    scheduling: str = "continuous"
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True

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
