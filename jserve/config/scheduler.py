"""Frozen configuration of the scheduler and the KV cache; constructors validate, nothing else.

Defaults suit CPU serving of a ~135M-parameter model (SmolLM2-135M): a 512-token step is where
XLA's CPU matmuls reach most of their peak, and 32 sequences keep decode steps short enough for
interactive streaming (bench/RESULTS.md has the step times measured, with the CPU they ran on).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import StrEnum

from jserve.config.settings import Bounds, InvalidSetting, check_settings, documented, setting
from jserve.config.speculative import SpeculativeConfig, parse_speculative_config
from jserve.config.validation import INT32_MAX


class Lane(StrEnum):
    """Scheduling lanes in strict priority order, highest first (the HTTP field `lane` names
    one; iterating the class gives that order)."""

    INTERACTIVE = "interactive"
    LONG = "long"
    BATCH = "batch"


# The lanes as a tuple, highest first: sliceable, and `in` takes any string (on the class
# itself, Python 3.11 refuses a string that is not a member).
LANES: tuple[Lane, ...] = tuple(Lane)


class SchedulingPolicy(StrEnum):
    """Iteration-level batching, or static batches (a baseline for benchmarks)."""

    CONTINUOUS = "continuous"
    STATIC = "static"


class FairnessPolicy(StrEnum):
    """Order inside a lane: virtual-token-counter fair share between tenants, or arrival."""

    VTC = "vtc"
    FCFS = "fcfs"


_COUNT = Bounds(1, INT32_MAX)  # a count the engine holds in int32 arrays
_FRACTION_OPEN_LOW = Bounds(0.0, 1.0, lo_open=True)


def _require(ok: bool, name: str, message: str) -> None:
    if not ok:
        raise InvalidSetting(name, message)


@documented
@dataclass(frozen=True)
class SchedulerConfig:
    """What the scheduler may put into one iteration, and which waiting work goes first.

    Settings marked adjustable may change at run time (POST /admin/scheduler, through
    jserve.core.control), within their declared range."""

    max_num_seqs: int = setting(
        32, "sequences in one step, i.e. requests running at once", vllm="--max-num-seqs",
        bounds=_COUNT, adjustable=True,
    )  # fmt: skip
    max_num_batched_tokens: int = setting(
        512,
        "tokens computed in one step, decode tokens plus prefill chunks",
        vllm="--max-num-batched-tokens",
        bounds=_COUNT,
        adjustable=True,
    )
    max_model_len: int = setting(
        2048,
        "longest prompt plus output of one request, in tokens",
        vllm="--max-model-len",
        bounds=_COUNT,
    )
    long_prefill_token_threshold: int = setting(
        0,
        "most prefill tokens one request may compute in one step, at most "
        "max_num_batched_tokens; 0 = no cap but the step's",
        vllm="--long-prefill-token-threshold",
        bounds=Bounds(0, INT32_MAX),
        adjustable=True,
    )
    long_prompt_threshold: int = setting(
        512, "a prompt longer than this many tokens waits and runs in the 'long' lane",
        bounds=_COUNT,
    )  # fmt: skip
    long_lane_max_share: float = setting(
        0.5,
        "fraction of a step's token budget the long lane's prefill may take while other work "
        "shares the step (alone it may take the whole step)",
        bounds=_FRACTION_OPEN_LOW,
        adjustable=True,
    )
    max_waiting_requests: int = setting(
        1024,
        "waiting-queue cap in sequences (each of a request's n samples counts); more are "
        "refused (HTTP 429, reason queue_full)",
        bounds=_COUNT,
    )
    free_block_watermark: float = setting(
        0.01,
        "fraction of KV blocks kept free: no new prefill starts below it (the high watermark "
        "is 1 minus this)",
        bounds=Bounds(0.0, 1.0, hi_open=True),
        adjustable=True,
    )
    kv_reject_watermark: float = setting(
        1.0,
        "KV usage above which new requests are refused (HTTP 503, reason kv_full); 1 = never",
        bounds=_FRACTION_OPEN_LOW,
        adjustable=True,
    )
    aging_iterations: int = setting(
        64,
        "steps a lane's oldest waiting request may wait before it goes ahead of strict lane "
        "order, so no request waits forever",
        bounds=_COUNT,
        adjustable=True,
    )
    scheduling: SchedulingPolicy = setting(
        SchedulingPolicy.CONTINUOUS,
        "continuous (iteration-level) or static (admit a batch only when nothing runs, then run "
        "it until every member finishes: a baseline for benchmarks)",
        choices=SchedulingPolicy,
    )
    fairness: FairnessPolicy = setting(
        FairnessPolicy.VTC,
        "order inside a lane: vtc (fair share between tenants by virtual token counters, FIFO "
        "within a tenant) or fcfs (arrival order)",
        choices=FairnessPolicy,
        adjustable=True,
    )
    deadline_admission: bool = setting(
        True,
        "refuse at arrival a request whose timeout its estimated finish time (priced from "
        "measured step costs) misses (HTTP 429, reason deadline); off, deadlines only expire",
        adjustable=True,
    )
    target_itl_ms: float = setting(
        0.0,
        "inter-token latency target of running decodes, in ms: each step takes as many prefill "
        "tokens as the precompiled bucket whose measured step time fits it allows; 0 = a "
        "fixed budget of max_num_batched_tokens",
        bounds=Bounds(0.0),
        adjustable=True,
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
    speculative_config: str | None = setting(
        None,
        'speculative decoding as a JSON object, e.g. {"method": "ngram", '
        '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}: drafts '
        "of unconstrained sequences verified in the step that computes them "
        "(docs/speculative.md)",
        vllm="--speculative-config",
        default_text="off",
    )

    def __post_init__(self) -> None:
        check_settings(self)  # each field's type and range
        parse_speculative_config(self.speculative_config)  # a bad one is refused here
        _require(
            self.max_num_batched_tokens >= self.max_num_seqs,
            "max_num_batched_tokens",
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
            f"({self.max_num_seqs}) so every running sequence can decode in each step",
        )
        _require(
            self.long_prefill_token_threshold <= self.max_num_batched_tokens,
            "long_prefill_token_threshold",
            f"long_prefill_token_threshold must be in [0, max_num_batched_tokens="
            f"{self.max_num_batched_tokens}] (0 = no cap), got {self.long_prefill_token_threshold}",
        )
        if not self.enable_chunked_prefill:
            self._check_whole_prefill()

    @functools.cached_property
    def speculative(self) -> SpeculativeConfig | None:
        """`speculative_config` parsed (None: speculation off)."""
        return parse_speculative_config(self.speculative_config)

    def _check_whole_prefill(self) -> None:
        _require(
            self.max_num_batched_tokens >= self.max_model_len,
            "max_num_batched_tokens",
            f"without chunked prefill a whole prompt must fit in one step: "
            f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= "
            f"max_model_len ({self.max_model_len}); raise it or enable chunked prefill",
        )
        _require(
            self.target_itl_ms == 0.0,
            "target_itl_ms",
            "target_itl_ms adapts the prefill chunk and needs enable_chunked_prefill=True",
        )
        _require(
            self.long_prefill_token_threshold == 0,
            "long_prefill_token_threshold",
            f"long_prefill_token_threshold ({self.long_prefill_token_threshold}) splits "
            f"prompts and needs enable_chunked_prefill=True; set it to 0",
        )


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV pool: `num_blocks` blocks of `block_size` tokens (block 0 is the pad sink)."""

    block_size: int = 16
    num_blocks: int = 2048

    def __post_init__(self) -> None:
        _require(
            self.block_size >= 1, "block_size", f"block_size must be >= 1, got {self.block_size}"
        )
        _require(
            self.num_blocks >= 2,
            "num_blocks",
            f"num_blocks must be >= 2 (block 0 is the padding sink), got {self.num_blocks}",
        )
