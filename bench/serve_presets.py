"""The A/B comparisons bench.serve_compare runs: two jserve configurations, one workload each.

Each preset names a baseline (A) and the feature under test (B), the server flags of each, a
workload builder of bench.workloads (full size and a tiny smoke size), how requests arrive,
and the headline metric with its goal. In smoke mode both sides are mock servers that differ
only in token delay (the engine flags mean nothing to the mock), so a smoke ratio tests the
plumbing, not jserve.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from bench.workloads import (
    WorkloadBuilder,
    decodes_then_long_prompts,
    flood_then_light_tenant,
    shared_prefix,
    shared_system_prompts,
    varying_lengths,
)


@dataclass(frozen=True)
class Side:
    label: str
    server_args: tuple[str, ...]
    mock_args: tuple[str, ...]


@dataclass(frozen=True)
class Headline:
    """The metric a preset is about: summary[key][stat] (of one group when `group` is set)."""

    key: str
    stat: str | None
    higher_is_better: bool
    goal: float
    group: str | None = None

    def value(self, report: dict) -> float | None:
        summary = report["groups"][self.group] if self.group else report["summary"]
        value = summary[self.key]
        return value[self.stat] if self.stat else value

    def describe(self) -> str:
        name = f"{self.key}[{self.stat}]" if self.stat else self.key
        return f"{name}{f' of group {self.group}' if self.group else ''}"


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    a: Side
    b: Side
    build: WorkloadBuilder
    headline: Headline
    max_concurrency: int | None = None
    extra_server_args: tuple[str, ...] = field(default=())


FAST_MOCK, SLOW_MOCK = ("--mock-token-delay", "0.005"), ("--mock-token-delay", "0.01")

PRESETS = {
    p.name: p
    for p in (
        Preset(
            "static-vs-continuous",
            "96 requests at once, 16 at a time, log-normal output lengths; static vs continuous",
            Side("static", ("--scheduling", "static"), SLOW_MOCK),
            Side("continuous", ("--scheduling", "continuous"), FAST_MOCK),
            varying_lengths,
            Headline("output_throughput", None, higher_is_better=True, goal=2.0),
            extra_server_args=("--max-num-seqs", "16"),
        ),
        Preset(
            "prefix-cache",
            "24 requests sharing a 1024-token system prompt, 4 in flight; prefix caching off/on",
            Side("no-prefix-cache", ("--no-enable-prefix-caching",), SLOW_MOCK),
            Side("prefix-cache", ("--enable-prefix-caching",), FAST_MOCK),
            shared_prefix,
            Headline("ttft_ms", "p50", higher_is_better=False, goal=3.0),
            max_concurrency=4,
        ),
        Preset(
            "chunked-prefill",
            "8 long decodes; 1536-token prompts arrive every 4 s; chunked prefill off/on",
            Side(
                "whole-prefill",
                ("--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"),
                SLOW_MOCK,
            ),
            Side(
                "chunked-prefill",
                ("--enable-chunked-prefill", "--max-num-batched-tokens", "256"),
                FAST_MOCK,
            ),
            decodes_then_long_prompts,
            Headline("itl_ms", "p99", higher_is_better=False, goal=2.0, group="decode"),
            extra_server_args=("--max-model-len", "2048"),
        ),
        Preset(
            "fairness",
            "tenant A floods 4x tenant B's requests at t=0, B's arrive every 0.7 s, 4 sequences "
            "at a time; FCFS vs fair share (virtual token counters)",
            Side("fcfs", ("--fairness", "fcfs"), SLOW_MOCK),
            Side("fair-share", ("--fairness", "vtc"), FAST_MOCK),
            flood_then_light_tenant,
            Headline("ttft_ms", "p99", higher_is_better=False, goal=3.0, group="B"),
            extra_server_args=("--max-num-seqs", "4"),
        ),
        Preset(
            "adaptive-budget",
            "the chunked-prefill workload with a 512-token budget, fixed vs --target-itl-ms 450",
            Side("fixed-512", (), SLOW_MOCK),
            Side("target-itl", ("--target-itl-ms", "450"), FAST_MOCK),
            decodes_then_long_prompts,
            Headline("itl_ms", "p99", higher_is_better=False, goal=2.0, group="decode"),
            extra_server_args=("--max-model-len", "2048", "--max-num-batched-tokens", "512"),
        ),
    )
}


@dataclass(frozen=True)
class RouterPreset:
    """Policies compared in front of the same replicas (bench.router_bench runs it)."""

    name: str
    description: str
    policies: tuple[str, ...]  # the first is the baseline of every gain
    replicas: int
    server_args: tuple[str, ...]  # every replica's `jserve serve` flags
    mock_args: tuple[str, ...]  # the mock replicas' flags in smoke mode
    block_size: int  # the replicas' KV block size, which the KV events describe
    build: WorkloadBuilder
    max_concurrency: int
    fault_policy: str  # the policy of the fault phase
    fault_requests: int  # the fault phase runs the workload's first requests
    fault_output_len: int  # with answers this long (smoke: the workload's own)
    kill_after_s: float  # the fault phase kills a replica this long after it starts
    kill_after_s_smoke: float
    # (policy, table row, reference policy, least gain of policy over reference)
    goals: tuple[tuple[str, str, str, float], ...] = ()


ROUTER_PRESETS = {
    "router": RouterPreset(
        "router",
        "2 replicas, 8 tenants' 512-token system prompts (a KV pool holds about 4), 128 requests "
        "3 in flight; round_robin vs cache_aware (smg) vs kv_aware (vllm-router, KV events)",
        ("round_robin", "cache_aware", "kv_aware"),
        replicas=2,
        # A request is 36 blocks: its tenant's 32 shared ones and 4 of its own. 144 usable
        # blocks hold 4 prompts and the own blocks of 3 running requests: exactly the 4
        # tenants a cache-aware router gives each replica, and 4.25 of the 8 under round robin.
        # 3 in flight keep KV usage (referenced blocks, at most 3 x 36 / 145 = 0.74) under
        # smg's 0.8 overload veto, which would send a request away from its cached prompt.
        server_args=("--num-kv-blocks", "145", "--max-model-len", "1024", "--max-num-seqs", "8"),
        mock_args=("--mock-token-delay", "0.02"),
        block_size=16,
        build=shared_system_prompts,
        max_concurrency=3,
        fault_policy="cache_aware",
        fault_requests=32,
        fault_output_len=48,
        kill_after_s=8.0,
        kill_after_s_smoke=0.3,
        goals=(
            ("cache_aware", "prefix-cache hit rate", "round_robin", 2.0),
            ("cache_aware", "TTFT p50 (ms)", "round_robin", 1.5),
            ("kv_aware", "prefix-cache hit rate", "cache_aware", 1.0),
            ("kv_aware", "TTFT p50 (ms)", "cache_aware", 1.0),
        ),
    )
}
