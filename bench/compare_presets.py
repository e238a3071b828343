"""The A/B comparisons bench/compare.py runs: two jserve configurations and one workload each.

Each preset names a baseline (A) and the feature under test (B), the server flags of each, a
workload builder (full size and a tiny smoke size), how requests arrive, and the headline
metric with its goal. In smoke mode both sides are mock servers that differ only in token delay
(the engine flags mean nothing to the mock), so a smoke ratio tests the plumbing, not jserve.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
from workloads import LengthDist, RequestSpec, TextMaker

WorkloadBuilder = Callable[[TextMaker, np.random.Generator, bool], Awaitable[list[RequestSpec]]]


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


async def _specs(
    maker: TextMaker, rng: np.random.Generator, n: int, prompt: str, output: str, **kw: object
) -> list[RequestSpec]:
    prompt_lens = LengthDist.parse(prompt).sample(rng, n)
    output_lens = LengthDist.parse(output).sample(rng, n)
    return [
        RequestSpec(await maker.text(p), o, **kw)  # type: ignore[arg-type]
        for p, o in zip(prompt_lens, output_lens, strict=True)
    ]


async def varying_lengths(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """All at once, six times the sequence cap; short prompts and log-normal output lengths with
    a long tail (median 24, a few past 200: what static batching hates)."""
    if smoke:
        return await _specs(maker, rng, 12, "uniform:8:32", "uniform:2:40")
    return await _specs(maker, rng, 96, "lognormal:32:0.5:256", "lognormal:24:1.2:256")


async def shared_prefix(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """One long system prompt, short distinct user turns, short answers."""
    n, prefix_len, user, output = (8, 96, "8", "4") if smoke else (24, 1024, "32", "16")
    system = await maker.text(prefix_len)
    return await _specs(maker, rng, n, user, output, system=system)


async def decodes_then_long_prompts(
    maker: TextMaker, rng: np.random.Generator, smoke: bool
) -> list:
    """Group "decode": short prompts with long outputs, all sent at t=0. Group "prefill": long
    prompts with tiny outputs arriving one by one while those decodes run."""
    if smoke:
        decode_n, decode_out, prefill_n, prefill_len, gap = 4, "60", 2, "100", 0.2
    else:
        decode_n, decode_out, prefill_n, prefill_len, gap = 8, "160", 4, "1536", 4.0
    decodes = await _specs(maker, rng, decode_n, "32", decode_out, group="decode", arrival_s=0.0)
    prefills = [
        RequestSpec(s.prompt, s.max_tokens, group="prefill", arrival_s=gap * (i + 1))
        for i, s in enumerate(await _specs(maker, rng, prefill_n, prefill_len, "4"))
    ]
    return decodes + prefills


async def flood_then_light_tenant(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """Tenant A floods the queue with four times tenant B's requests at t=0 and stays
    backlogged behind the sequence cap; B's arrive one every `gap` seconds from t=0.5, about
    1.4x the half of the engine that is B's fair share (4 sequences serve about 2 of these
    requests a second on a 2-core CPU), so B keeps a queue too. Groups and tenants are "A"
    and "B".

    B's requests arrive over time, not all at once: a burst of B's gets, with equal weights,
    at best every other free slot, so its last request still waits for about twice its
    burst's admissions, which caps the p99 gain near 2.3x whatever the policy. B's 40 keep
    both tenants waiting for about 28 s: long against what fair share may let a tenant's
    admitted requests run ahead (4 sequences' worth, jserve.core.fairness), so B's share of
    the tokens served meanwhile shows the policy, not that allowance."""
    heavy, light, gap = (8, 2, 0.05) if smoke else (160, 40, 0.7)
    a = await _specs(maker, rng, heavy, "uniform:48:96", "32", group="A", arrival_s=0.0)
    b = await _specs(maker, rng, light, "uniform:48:96", "32", group="B")
    return [RequestSpec(s.prompt, s.max_tokens, group=s.group, tenant=s.group,
                        arrival_s=0.0 if s.group == "A" else 0.5 + gap * (i - heavy))
            for i, s in enumerate(a + b)]  # fmt: skip


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


async def tenants(
    maker: TextMaker, rng: np.random.Generator, n: int, num_systems: int, system_len: int,
    user_len: int, output_len: int,
) -> list[RequestSpec]:  # fmt: skip
    """`n` requests, each with one of `num_systems` system prompts (its tenant's) and its own
    user turn, in a seeded random order (an order that alternated tenants would let round
    robin partition them by parity, which no real traffic does)."""
    systems = [await maker.text(system_len) for _ in range(num_systems)]
    owners = rng.permutation(np.arange(n) % num_systems)
    return [RequestSpec(await maker.text(user_len), output_len, system=systems[int(o)],
                        tenant=f"tenant{int(o)}") for o in owners]  # fmt: skip


async def shared_system_prompts(maker: TextMaker, rng: np.random.Generator, smoke: bool) -> list:
    """8 tenants' system prompts of 512 tokens (32 blocks; a replica's KV pool holds about 4
    of them besides its running requests), 128 requests with their own 32-token user turns and
    16-token answers (16 a tenant, so the 8 first requests, which no router can place on a
    cached prompt, are a sixteenth of the run)."""
    if smoke:
        return await tenants(maker, rng, 12, 4, 64, 8, 20)
    return await tenants(maker, rng, 128, 8, 512, 32, 16)


@dataclass(frozen=True)
class RouterPreset:
    """Policies compared in front of the same replicas (bench/router_bench.py runs it)."""

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
