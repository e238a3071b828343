"""Prometheus metrics, named like vLLM's with a `jserve:` prefix.

Two sources:
1. Engine-side numbers (running/waiting requests, KV usage, prefix cache, preemptions, token
   counters, compilations, per-iteration token counts, speculative decoding's drafts and
   acceptance, per draft position too) come from one `engine.stats()` snapshot
   taken when /metrics is scraped; cumulative engine counters are exported as counters. The
   served model's name and quantization are `jserve:model_info`'s labels; the KV pool's
   block size, element dtype and block count `jserve:cache_config_info`'s (vLLM's names).
2. Per-request latencies (TTFT, ITL, end to end, queued, running, prefill, decode), sizes and
   outcomes are observed by the server while it streams, from the engine's RequestMetrics
   timestamps when given (else the server's own clock). Some are also split by lane and
   tenant in `jserve:tenant_*` series (TTFT, ITL, queue time, finished requests by reason -
   "abort" counts cancellations, "timeout" deadline misses -, rejections by reason, served
   prompt and generated tokens). The tenant label's cardinality is bounded
   (jserve.core.tenants.TenantLabels): tenants past the limit report as "other".
Each app has its own CollectorRegistry, so several apps (tests) never share series.
/metrics renders them followed by vLLM's names of the same series (jserve.server.vllm_metrics).
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from jserve.config.scheduler import Lane
from jserve.core.tenants import DEFAULT_TENANT, TenantLabels
from jserve.errors import RejectReason
from jserve.outputs import EngineStats, RequestMetrics, RequestOutput
from jserve.server.vllm_metrics import (
    VLLM_ITERATION_TOKEN_BUCKETS,
    VLLM_ITL_BUCKETS,
    VLLM_N_BUCKETS,
    VLLM_REQUEST_LATENCY_BUCKETS,
    VLLM_TOKEN_COUNT_BUCKETS,
    VLLM_TTFT_BUCKETS,
    vllm_families,
)

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0,
)  # fmt: skip

# EngineStats field -> (metric name without prefix, help text)
_ENGINE_GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in the running batch."),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be scheduled."),
    "kv_cache_usage": ("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1)."),
}
_ENGINE_COUNTERS = {
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the cache."),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache."),
    "num_preemptions": ("num_preemptions", "Requests preempted (KV freed, recomputed)."),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens processed."),
    "generation_tokens": ("generation_tokens", "Tokens generated."),
    "compilations": ("compilations", "XLA compilations (and compile-cache loads) so far."),
    "serving_compilations": (
        "serving_compilations",
        "XLA compilations after warm-up: each is a shape outside the precompiled buckets.",
    ),
    "num_restarts": ("engine_restarts", "In-process engine restarts after a failed step."),
    "spec_decode_num_drafts": (
        "spec_decode_num_drafts",
        "Speculative verify steps of one sequence (drafts proposed).",
    ),
    "spec_decode_num_draft_tokens": ("spec_decode_num_draft_tokens", "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": (
        "spec_decode_num_accepted_tokens",
        "Draft tokens accepted (equal to the target's).",
    ),
}
_SPEC_DECODE_GAUGES = {
    "spec_decode_acceptance_rate": (
        "spec_decode_acceptance_rate",
        "Accepted draft tokens per draft token since start.",
    ),
    "spec_decode_mean_acceptance_length": (
        "spec_decode_mean_acceptance_length",
        "Tokens per speculative verify step since start: accepted drafts plus the target's.",
    ),
}


class _EngineSnapshotCollector:
    """Exports the last engine snapshot taken by ServerMetrics.refresh()."""

    def __init__(self) -> None:
        self.snapshot = EngineStats()

    def collect(self) -> Iterator[Metric]:
        for attr, (name, doc) in _ENGINE_GAUGES.items():
            yield GaugeMetricFamily(f"jserve:{name}", doc, value=getattr(self.snapshot, attr))
        for attr, (name, doc) in _ENGINE_COUNTERS.items():
            yield CounterMetricFamily(f"jserve:{name}", doc, value=getattr(self.snapshot, attr))
        for attr, (name, doc) in _SPEC_DECODE_GAUGES.items():
            yield GaugeMetricFamily(f"jserve:{name}", doc, value=getattr(self.snapshot, attr))
        per_pos = CounterMetricFamily(
            "jserve:spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0 = the first draft).",
            labels=["position"],
        )
        for position, count in enumerate(self.snapshot.spec_decode_num_accepted_tokens_per_pos):
            per_pos.add_metric([str(position)], count)
        yield per_pos


_BY_TENANT = ["lane", "tenant"]


class ServerMetrics:
    def __init__(self, tenant_labels: TenantLabels | None = None) -> None:
        self.tenant_label = tenant_labels or TenantLabels()
        self.registry = CollectorRegistry()
        self._engine = _EngineSnapshotCollector()
        self.registry.register(self._engine)
        self._declare_request_series(self.registry)
        self._declare_latency_series(self.registry)
        self._declare_tenant_series(self.registry)

    def _declare_request_series(self, reg: CollectorRegistry) -> None:
        """Requests' outcomes and sizes, the engine's iteration sizes, and what is served."""
        self.request_success = Counter(
            "jserve:request_success", "Finished sequences by finish reason (one per choice).",
            ["finished_reason"], registry=reg,
        )  # fmt: skip
        self.request_rejected = Counter(
            "jserve:request_rejected", "Requests refused before generation, by reason.",
            ["reason"], registry=reg,
        )  # fmt: skip
        self.request_prompt_tokens = Histogram(
            "jserve:request_prompt_tokens", "Prompt tokens of each finished sequence.",
            buckets=VLLM_TOKEN_COUNT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.request_generation_tokens = Histogram(
            "jserve:request_generation_tokens", "Generated tokens of each finished sequence.",
            buckets=VLLM_TOKEN_COUNT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.request_max_generation_tokens = Histogram(
            "jserve:request_max_num_generation_tokens",
            "Generated tokens of each finished request's longest choice.",
            buckets=VLLM_TOKEN_COUNT_BUCKETS, registry=reg,
        )  # fmt: skip
        self.request_n = Histogram(
            "jserve:request_params_n", "Choices (n) of each finished request.",
            buckets=VLLM_N_BUCKETS, registry=reg,
        )  # fmt: skip
        self.iteration_tokens = Histogram(
            "jserve:iteration_tokens", "Tokens scheduled per engine iteration.",
            buckets=VLLM_ITERATION_TOKEN_BUCKETS, registry=reg,
        )  # fmt: skip
        self.model_info = Gauge(
            "jserve:model_info", "The served model and its weights as served (always 1): "
            'quantization "none" or "gguf:" and its packed block formats.',
            ["model_name", "quantization"], registry=reg,
        )  # fmt: skip
        self.cache_config_info = Gauge(
            "jserve:cache_config_info", "The KV pool (always 1): tokens per block, its elements "
            '("float32", "int8", "float8_e4m3fn", ...) and its blocks, the sink included.',
            ["block_size", "cache_dtype", "num_gpu_blocks"], registry=reg,
        )  # fmt: skip

    def _declare_latency_series(self, reg: CollectorRegistry) -> None:
        """Requests' latencies and phases. Each histogram's bounds include vLLM's, which the
        `vllm:` series re-emitted from it keep."""

        def seconds(name: str, doc: str, vllm_buckets: tuple[float, ...]) -> Histogram:
            buckets = sorted({*_LATENCY_BUCKETS, *vllm_buckets})
            return Histogram(f"jserve:{name}", doc, buckets=buckets, registry=reg)

        self.ttft = seconds(
            "time_to_first_token_seconds", "Arrival to first token.", VLLM_TTFT_BUCKETS
        )
        self.itl = seconds(
            "inter_token_latency_seconds", "Time between consecutive tokens of a request.",
            VLLM_ITL_BUCKETS,
        )  # fmt: skip
        self.e2e = seconds(
            "e2e_request_latency_seconds", "Arrival to finish.", VLLM_REQUEST_LATENCY_BUCKETS
        )
        self.queue_time = seconds(
            "request_queue_time_seconds", "Arrival to first scheduling.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.inference_time = seconds(
            "request_inference_time_seconds", "First scheduling to last token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.prefill_time = seconds(
            "request_prefill_time_seconds", "First scheduling to first token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip
        self.decode_time = seconds(
            "request_decode_time_seconds", "First token to last token.",
            VLLM_REQUEST_LATENCY_BUCKETS,
        )  # fmt: skip

    def _declare_tenant_series(self, reg: CollectorRegistry) -> None:
        """The `jserve:tenant_*` series: latencies, outcomes and tokens by lane and tenant."""
        self.tenant_ttft = Histogram(
            "jserve:tenant_time_to_first_token_seconds",
            "Arrival to first token, by lane and tenant.",
            _BY_TENANT, buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tenant_itl = Histogram(
            "jserve:tenant_inter_token_latency_seconds", "Time between tokens, by lane and tenant.",
            _BY_TENANT, buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tenant_queue_time = Histogram(
            "jserve:tenant_request_queue_time_seconds",
            "Arrival to first scheduling, by lane and tenant.",
            _BY_TENANT, buckets=_LATENCY_BUCKETS, registry=reg,
        )  # fmt: skip
        self.tenant_finished = Counter(
            "jserve:tenant_request_finished", "Finished sequences by lane, tenant and reason "
            "(abort: cancelled; timeout: missed its deadline).",
            [*_BY_TENANT, "finished_reason"], registry=reg,
        )  # fmt: skip
        self.tenant_rejected = Counter(
            "jserve:tenant_request_rejected", "Requests refused, by lane, tenant and reason.",
            [*_BY_TENANT, "reason"], registry=reg,
        )  # fmt: skip
        self.tenant_tokens = Counter(
            "jserve:tenant_served_tokens", "Prompt and generated tokens of requests, by lane "
            "and tenant (kind: prompt or generation).",
            [*_BY_TENANT, "kind"], registry=reg,
        )  # fmt: skip

    def rejected(self, reason: RejectReason, lane: Lane, tenant: str) -> None:
        self.request_rejected.labels(reason).inc()
        self.tenant_rejected.labels(lane, self.tenant_label(tenant), reason).inc()

    @property
    def engine_snapshot(self) -> EngineStats:
        """The engine snapshot the last refresh() took in."""
        return self._engine.snapshot

    def refresh(self, stats: EngineStats) -> None:
        """Take in an engine snapshot (its iteration_tokens were drained for us)."""
        self._engine.snapshot = stats
        for tokens in stats.iteration_tokens:
            self.iteration_tokens.observe(tokens)

    def describe_engine(
        self,
        model_name: str,
        quantization: str,
        block_size: int,
        cache_dtype: str,
        num_blocks: int,
    ) -> None:
        """Set the info series: the served model and the KV cache's layout."""
        self.model_info.labels(model_name, quantization).set(1)
        self.cache_config_info.labels(str(block_size), cache_dtype, str(num_blocks)).set(1)

    def render(self, model_name: str) -> bytes:
        """The exposition: jserve's series, then vLLM's names of them (labelled with
        `model_name`), both from one collection."""
        return generate_latest(_Exposition(self.registry, model_name))

    def observe_phases(self, timing: RequestMetrics) -> None:
        """A finished request's time running, in prefill and in decode (when it had tokens)."""
        if timing.first_scheduled_time is None or timing.first_token_time is None:
            return
        last_token = timing.last_token_time or timing.first_token_time
        self.inference_time.observe(last_token - timing.first_scheduled_time)
        self.prefill_time.observe(timing.first_token_time - timing.first_scheduled_time)
        self.decode_time.observe(last_token - timing.first_token_time)


class _Exposition:
    """What /metrics renders: the registry's families, then vLLM's re-emission of them."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry, self.model_name = registry, model_name

    def collect(self) -> Iterator[Metric]:
        families = list(self.registry.collect())
        yield from families
        yield from vllm_families(families, self.model_name)


class RequestTracker:
    """Observes one request's latencies as its cumulative outputs stream by."""

    def __init__(
        self, metrics: ServerMetrics, lane: Lane = Lane.INTERACTIVE, tenant: str = DEFAULT_TENANT
    ) -> None:
        self.metrics = metrics
        self.labels = (lane, metrics.tenant_label(tenant))
        self.start = time.monotonic()
        self.steps = 0  # tokens per choice seen so far
        self.last_token_time: float | None = None

    def _arrival(self, output: RequestOutput) -> float:
        return output.metrics.arrival_time if output.metrics else self.start

    def on_output(self, output: RequestOutput) -> None:
        steps = max((len(c.token_ids) for c in output.outputs), default=0)
        if steps <= self.steps:
            return
        timing = output.metrics
        now = timing.last_token_time if timing and timing.last_token_time else time.monotonic()
        metrics, labels = self.metrics, self.labels
        if self.last_token_time is None:
            first = timing.first_token_time if timing and timing.first_token_time else now
            metrics.ttft.observe(first - self._arrival(output))
            metrics.tenant_ttft.labels(*labels).observe(first - self._arrival(output))
            if timing and timing.first_scheduled_time:
                queued = timing.first_scheduled_time - timing.arrival_time
                metrics.queue_time.observe(queued)
                metrics.tenant_queue_time.labels(*labels).observe(queued)
            metrics.tenant_tokens.labels(*labels, "prompt").inc(len(output.prompt_token_ids))
            new_intervals, since = steps - 1, first
        else:
            new_intervals, since = steps - self.steps, self.last_token_time
        # Several steps can arrive in one output when the consumer lags: spread them evenly.
        tenant_itl = metrics.tenant_itl.labels(*labels)
        for _ in range(new_intervals):
            metrics.itl.observe((now - since) / new_intervals)
            tenant_itl.observe((now - since) / new_intervals)
        self.steps, self.last_token_time = steps, now

    def on_finish(self, output: RequestOutput) -> None:
        metrics = self.metrics
        generated = sum(len(choice.token_ids) for choice in output.outputs)
        metrics.tenant_tokens.labels(*self.labels, "generation").inc(generated)
        for choice in output.outputs:
            reason = choice.finish_reason or "abort"
            metrics.request_success.labels(reason).inc()
            metrics.tenant_finished.labels(*self.labels, reason).inc()
            metrics.request_prompt_tokens.observe(len(output.prompt_token_ids))
            metrics.request_generation_tokens.observe(len(choice.token_ids))
        if output.outputs:
            metrics.request_n.observe(len(output.outputs))
            longest = max(len(choice.token_ids) for choice in output.outputs)
            metrics.request_max_generation_tokens.observe(longest)
        timing = output.metrics
        end = timing.finished_time if timing and timing.finished_time else time.monotonic()
        metrics.e2e.observe(end - self._arrival(output))
        if timing:
            metrics.observe_phases(timing)

    def on_client_gone(self, num_choices: int) -> None:
        self.metrics.request_success.labels("abort").inc(num_choices)
        self.metrics.tenant_finished.labels(*self.labels, "abort").inc(num_choices)
        self.metrics.e2e.observe(time.monotonic() - self.start)
