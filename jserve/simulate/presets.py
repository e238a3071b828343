"""The comparisons the scheduler's policies are judged by (docs/scheduling.md), simulated.

Each preset runs its workload under both cost models (the measured CPU table and a compile
report's roofline estimate, by default an 8B Llama on one H200), every side of a comparison on
the same requests, and returns a printed table.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable

import numpy as np

from jserve.config.scheduler import SchedulerConfig
from jserve.core.buckets import engine_buckets
from jserve.core.step_costs import StepCosts
from jserve.simulate.costs import CompiledEngine, CostModel, MeasuredCost
from jserve.simulate.metrics import summarize
from jserve.simulate.report import fmt, tenant_figures, text_table
from jserve.simulate.simulator import simulate
from jserve.simulate.workload import SimRequest, synthetic

KV_BLOCKS = 4096
DEFAULT_COMPILE_REPORT = "bench/results/compile_llama-3-8b_h200.json"


def engine_config(**overrides: object) -> SchedulerConfig:
    base = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 2048}
    return SchedulerConfig(**{**base, **overrides})  # type: ignore[arg-type]


def cost_models(args: argparse.Namespace) -> list[tuple[str, CostModel, Callable[[], StepCosts]]]:
    """(label, cost model, factory of the scheduler's StepCosts) for each cost model: the
    measured CPU table and a compile report's roofline estimate (default: an 8B Llama on one
    H200, whose engine runs the presets' 32 sequences and 512-token steps)."""
    token_buckets, seq_buckets = engine_buckets(512, 32, decode_midpoints=True)  # a CPU's
    measured = MeasuredCost.from_report(args.bucket_report, token_buckets, seq_buckets)
    path = args.compile_report or DEFAULT_COMPILE_REPORT
    compiled = CompiledEngine.from_report(path)
    base = engine_config()
    if compiled.seq_buckets[-1] < base.max_num_seqs:
        raise ValueError(f"{path}: the presets run {base.max_num_seqs} sequences a step; its "
                         f"engine was compiled for {compiled.seq_buckets[-1]}")  # fmt: skip
    if compiled.token_buckets[-1] < base.max_num_batched_tokens:
        raise ValueError(f"{path}: the presets run {base.max_num_batched_tokens}-token steps; "
                         f"its engine was compiled for {compiled.token_buckets[-1]}")  # fmt: skip
    estimate = compiled.cost_model()
    return [
        ("measured (CPU table)", measured, measured.fresh_table),
        (estimate.label, estimate, compiled.fresh_table),
    ]


def fairness(args: argparse.Namespace) -> str:
    """Tenants A and B both backlogged, A sending 4x B's requests: FCFS vs fair share."""
    out = []
    for label, model, costs in cost_models(args):
        rate = args.rate or (6.0 if "CPU" in label else 200.0)
        workload = synthetic(args.num_requests or 200, rate, "uniform:64:256", "uniform:32:96",
                             {"A": 4.0, "B": 1.0}, args.seed)  # fmt: skip
        rows = [["policy", "B share*", "A share*", "B TTFT p99 ms", "A TTFT p99 ms", "A tok/s"]]
        for policy in ("fcfs", "vtc"):
            result = simulate(workload, engine_config(fairness=policy), KV_BLOCKS, model, costs())
            t = tenant_figures(result)
            rows.append([
                policy, fmt(t["B"]["served_share"], ".1%"), fmt(t["A"]["served_share"], ".1%"),
                fmt(t["B"]["ttft_p99_ms"]), fmt(t["A"]["ttft_p99_ms"]), fmt(t["A"]["output_tok_s"]),
            ])  # fmt: skip
        out.append(f"== fairness, {label} [simulated], {rate:g} req/s, A:B = 4:1 ==")
        out.append(text_table(rows))
        out.append("* share of the tokens served while both tenants had requests waiting")
    return "\n".join(out)


def deadline(args: argparse.Namespace) -> str:
    """A sustained overload in which half the requests carry a short deadline (interactive
    lane; the rest are batch work without one): early rejection (the scheduler prices each
    deadline at arrival) vs letting them time out.

    The deadline half alone offers more than the engine serves, for about five deadlines'
    length: that is when letting deadlines expire collapses, since the queue's head has
    waited nearly its whole deadline by the time it starts, and most of what it computes is
    lost. Goodput counts the deadline requests that finish in time, per second of the same
    window on both sides (first arrival to the last arrival plus the timeout, by which each
    of them has finished, expired or been refused); batch requests have no deadline and are
    left out of it.
    """
    out = []
    for label, model, costs in cost_models(args):
        cpu = "CPU" in label
        rate = args.rate or (8.0 if cpu else 200.0)
        timeout = 30.0 if cpu else 1.0
        num_requests = args.num_requests or (1200 if cpu else 2000)
        workload = [
            dataclasses.replace(w, lane="interactive" if w.timeout else "batch")
            for w in synthetic(num_requests, rate, "uniform:64:192", "uniform:16:64",
                               {"default": 1.0}, args.seed, timeout=timeout,
                               timeout_fraction=0.5)
        ]  # fmt: skip
        window = max(w.arrival_s for w in workload) + timeout - workload[0].arrival_s
        rows = [["admission", "admitted misses", "rejected", "deadline reqs in time",
                 "goodput req/s", "all done req/s*"]]  # fmt: skip
        goodputs = []
        for name, admission in (("let time out", False), ("early rejection", True)):
            config = engine_config(deadline_admission=admission)
            result = simulate(workload, config, KV_BLOCKS, model, costs())
            rejected = sum(r.error.startswith("rejected") for r in result.records)
            in_time = sum(
                1 for w, r in zip(workload, result.records, strict=True)
                if w.timeout is not None and r.success and r.e2e <= w.timeout
            )  # fmt: skip
            goodputs.append(in_time / window)
            rows.append([name, str(result.deadline_misses), str(rejected), str(in_time),
                         f"{goodputs[-1]:.3f}",
                         f"{result.within_deadline / result.duration:.3f}"])  # fmt: skip
        out.append(f"== deadline admission, {label} [simulated], {num_requests} requests at "
                   f"{rate:g} req/s, half with timeout {timeout:g} s ==")  # fmt: skip
        out.append(text_table(rows))
        out.append("* requests done within their deadline or without one, per second of the "
                   "whole run (until the batch backlog drains)")  # fmt: skip
        out.append(f"goodput ratio (early / time out): {goodputs[1] / max(goodputs[0], 1e-9):.2f}x")
    return "\n".join(out)


def adaptive(args: argparse.Namespace) -> str:
    """Chunked prefill: running decodes plus long prompts; fixed largest budget vs a
    target_itl_ms that keeps decode steps under it."""
    out = []
    for label, model, costs in cost_models(args):
        cpu = "CPU" in label
        target = args.target_itl_ms or (450.0 if cpu else 11.0)
        decodes = [SimRequest(0.0, 32, 400 if cpu else 1900, "decode") for _ in range(8)]
        period = 4.0 if cpu else 0.05
        longs = [SimRequest(1.0 + period * i, 1536, 1, "prefill") for i in range(12)]
        rows = [["budget", "decode ITL p50 ms", "decode ITL p99 ms", "prefill tok/s"]]
        for name, target_ms in (("fixed 512", 0.0), (f"target {target:g} ms", target)):
            config = engine_config(target_itl_ms=target_ms)
            result = simulate(decodes + longs, config, KV_BLOCKS, model, costs())
            itl = [g * 1000 for r in result.records if r.group == "decode" for g in r.itl]
            pre = [r for r in result.records if r.group == "prefill" and r.success]
            span = max(r.start + r.e2e for r in pre) - min(r.start for r in pre)
            rows.append([name, fmt(float(np.percentile(itl, 50))),
                         fmt(float(np.percentile(itl, 99))),
                         fmt(sum(r.prompt_tokens for r in pre) / span)])  # fmt: skip
        out.append(f"== adaptive budget, {label} [simulated] ==")
        out.append(text_table(rows))
    return "\n".join(out)


def policies(args: argparse.Namespace) -> str:
    """Static vs continuous batching vs continuous with fair share, under both cost models."""
    out = []
    for label, model, costs in cost_models(args):
        rate = args.rate or (4.0 if "CPU" in label else 150.0)
        workload = synthetic(args.num_requests or 200, rate, "lognormal:128:0.8:1024",
                             "lognormal:64:1.0:512", {"A": 4.0, "B": 1.0}, args.seed)  # fmt: skip
        rows = [["policy", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms"]]
        for name, overrides in (
            ("static", {"scheduling": "static", "fairness": "fcfs"}),
            ("continuous fcfs", {"fairness": "fcfs"}),
            ("continuous vtc", {"fairness": "vtc"}),
        ):
            result = simulate(workload, engine_config(**overrides), KV_BLOCKS, model, costs())
            s = summarize(result.records, result.duration)
            rows.append([name, f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                         fmt(s["ttft_ms"]["p50"]), fmt(s["ttft_ms"]["p99"]),
                         fmt(s["tpot_ms"]["p50"])])  # fmt: skip
        out.append(f"== batching policies, {label} [simulated], {rate:g} req/s ==")
        out.append(text_table(rows))
    return "\n".join(out)


PRESETS: dict[str, Callable[[argparse.Namespace], str]] = {
    "fairness": fairness,
    "deadline": deadline,
    "adaptive": adaptive,
    "policies": policies,
}
