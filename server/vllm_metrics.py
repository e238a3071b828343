"""vLLM's metric names, re-emitted from jserve's own series, so that a dashboard, alert or router
made for vLLM reads a jserve server unchanged.

Each `vllm:` family is a `jserve:` family of the same scrape, renamed, with vLLM's `model_name`
label (the served model name) added: one set of observations under two names, which cannot
drift apart. A latency or size histogram keeps only vLLM's bucket bounds: jserve's own
histogram has them among its (finer) ones, so the cumulative counts at vLLM's bounds are exact.
Names, types, units and buckets follow vLLM's v1 engine (`vllm/v1/metrics/loggers.py`); vLLM's
`engine` label (its data-parallel rank) is left out, as jserve serves one engine per server.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from prometheus_client.core import Metric

# vLLM's histogram bounds, as its Prometheus logger declares them.
VLLM_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
VLLM_ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
VLLM_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
VLLM_ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# vLLM's 1-2-5 series, which it cuts at the model's max_model_len; here it runs to 10M tokens
# (longer than any context), so the buckets past the served model's length stay empty.
VLLM_N_BUCKETS = (1, 2, 5, 10, 20)
VLLM_TOKEN_COUNT_BUCKETS = (*(m * 10**e for e in range(7) for m in (1, 2, 5)), 10**7)


@dataclass(frozen=True)
class VllmAlias:
    """One vLLM family and the jserve family it is re-emitted from."""

    source: str  # the jserve family's name (a counter's without `_total`)
    name: str  # vLLM's family name (likewise)
    doc: str
    buckets: tuple[float, ...] = ()  # a histogram's vLLM bounds (all of them in the source)

    def family(self, source: Metric, model_name: str) -> Metric:
        """The source family under vLLM's name, its samples labelled with the model name."""
        family = Metric(self.name, self.doc, source.type)
        bounds = set(self.buckets)
        for sample in source.samples:
            le = sample.labels.get("le")
            if le is not None and le != "+Inf" and float(le) not in bounds:
                continue
            suffix = sample.name[len(source.name) :]  # "", "_total", "_bucket", "_sum", ...
            labels = {**sample.labels, "model_name": model_name}
            family.samples.append(sample._replace(name=self.name + suffix, labels=labels))
        return family


def _alias(name: str, doc: str, buckets: tuple[float, ...] = (), source: str = "") -> VllmAlias:
    """The alias of `jserve:<source or name>` as `vllm:<name>`."""
    return VllmAlias(f"jserve:{source or name}", f"vllm:{name}", doc, buckets)


VLLM_ALIASES = (
    # Scheduler state and KV cache: the engine snapshot of the scrape.
    _alias("num_requests_running", "Number of requests in model execution batches."),
    _alias("num_requests_waiting", "Number of requests waiting to be processed."),
    _alias("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    _alias("prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."),
    _alias("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."),
    _alias("num_preemptions", "Cumulative number of preemption from the engine."),
    _alias("prompt_tokens", "Number of prefill tokens processed."),
    _alias("generation_tokens", "Number of generation tokens processed."),
    _alias("cache_config_info", "Information of the LLMEngine CacheConfig"),
    _alias(
        "iteration_tokens_total",
        "Histogram of number of tokens per engine_step.",
        VLLM_ITERATION_TOKEN_BUCKETS,
        source="iteration_tokens",
    ),
    # Speculative decoding.
    _alias("spec_decode_num_drafts", "Number of spec decoding drafts."),
    _alias("spec_decode_num_draft_tokens", "Number of draft tokens."),
    _alias("spec_decode_num_accepted_tokens", "Number of accepted tokens."),
    _alias("spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position."),
    # Requests: outcomes, sizes and latencies, observed by the server as they stream.
    _alias("request_success", "Count of successfully processed requests."),
    _alias(
        "request_prompt_tokens", "Number of prefill tokens processed.", VLLM_TOKEN_COUNT_BUCKETS
    ),
    _alias(
        "request_generation_tokens",
        "Number of generation tokens processed.",
        VLLM_TOKEN_COUNT_BUCKETS,
    ),
    _alias(
        "request_max_num_generation_tokens",
        "Histogram of maximum number of requested generation tokens.",
        VLLM_TOKEN_COUNT_BUCKETS,
    ),
    _alias("request_params_n", "Histogram of the n request parameter.", VLLM_N_BUCKETS),
    _alias(
        "time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        VLLM_TTFT_BUCKETS,
    ),
    _alias(
        "inter_token_latency_seconds",
        "Histogram of inter-token latency in seconds.",
        VLLM_ITL_BUCKETS,
    ),
    _alias(
        "time_per_output_token_seconds",
        "Histogram of time per output token in seconds. "
        "DEPRECATED: Use vllm:inter_token_latency_seconds instead.",
        VLLM_ITL_BUCKETS,
        source="inter_token_latency_seconds",
    ),
    _alias(
        "e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    _alias(
        "request_queue_time_seconds",
        "Histogram of time spent in WAITING phase for request.",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    _alias(
        "request_inference_time_seconds",
        "Histogram of time spent in RUNNING phase for request.",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    _alias(
        "request_prefill_time_seconds",
        "Histogram of time spent in PREFILL phase for request.",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
    _alias(
        "request_decode_time_seconds",
        "Histogram of time spent in DECODE phase for request.",
        VLLM_REQUEST_LATENCY_BUCKETS,
    ),
)


def vllm_families(jserve_families: Iterable[Metric], model_name: str) -> Iterator[Metric]:
    """vLLM's families, from the jserve families of one collection."""
    by_name = {family.name: family for family in jserve_families}
    for alias in VLLM_ALIASES:
        yield alias.family(by_name[alias.source], model_name)
