"""Capacity simulator: the real jserve.core scheduler driven in virtual time by a cost model.

No model runs. Each step the scheduler plans is priced by a cost model and the virtual clock
advances by that much; sampled tokens are a filler (no EOS: every request generates its
`max_tokens`, as bench/serve.py's ignore_eos does). Requests arrive from a workload (synthetic:
Poisson per tenant, or a JSONL file of {"arrival_s", "prompt_tokens", "max_tokens", "tenant",
"lane", "timeout"}), and the same TTFT/TPOT/ITL/E2E/throughput/goodput table as
bench/serve.py is printed, overall and per tenant, in seconds of real time.

Cost models:
- measured: step time per (tokens, seqs) bucket from a bench/buckets.py report (default
  bench/results/buckets_cpu.json, this CPU and SmolLM2-135M); a step costs its padded bucket.
- roofline: a GPU or TPU from its published figures: a step takes
  max(bytes moved / memory bandwidth, FLOPs / matmul rate) + a fixed launch overhead, where the
  bytes are the weights once plus the KV cache every sequence reads, and the FLOPs
  2 * parameters per token (defaults: an H200, 4.3 TB/s and 790 TFLOP/s bf16, serving an
  8B-parameter Llama-3-like model). Decode is then memory-bound: batching is nearly free.
Every figure printed is labelled simulated; `--preset` runs one of the comparisons the
scheduler's policies are judged by (docs/scheduling.md), each side by side in one invocation.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from array import array
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from serve_client import RequestRecord
from serve_metrics import format_summary, summarize, summarize_by_group
from workloads import LengthDist

from jserve.config.scheduler import LANES, CacheConfig, SchedulerConfig
from jserve.core.buckets import engine_buckets, make_seq_buckets, make_token_buckets, step_buckets
from jserve.core.plan import StepPlan
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.step_costs import StepCosts, load_bucket_report
from jserve.core.stopping import StopConditions
from jserve.core.tenants import TenantPolicy
from jserve.errors import RequestRejected

DEFAULT_REPORT = Path(__file__).resolve().parent / "results" / "buckets_cpu.json"
FILLER_TOKEN = 7


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    tenant: str = "default"
    lane: str = "interactive"
    timeout: float | None = None


# ---- cost models --------------------------------------------------------------------------


class MeasuredCost:
    """Seconds per step from a bench/buckets.py table (the step's padded bucket), plus the
    engine's host work per step (scheduling, input building, sampling, output processing)
    that the table's model-step times leave out."""

    label = "measured table"

    def __init__(self, costs: StepCosts, host_s: float = 0.0) -> None:
        self.costs = costs
        self.host_s = host_s

    @classmethod
    def from_report(
        cls, path: str, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]
    ) -> MeasuredCost:
        """The cost model of a bucket report (or a table a server learned) for these buckets."""
        table = StepCosts(token_buckets, seq_buckets, load_bucket_report(path))
        return cls(table, host_seconds_per_step(path))

    def __call__(self, plan: StepPlan) -> float:
        cost = self.costs.cost(plan.num_batched_tokens, len(plan.seqs))
        assert cost is not None, "the measured table is empty"
        return cost + self.host_s


def host_seconds_per_step(report_path: str) -> float:
    """The engine's time per step beyond the table's step times: the time between steps of a
    table the engine learned while serving (`jserve serve --save-step-costs`), or a
    bench/buckets.py report's workload run (its engine-step wall time less its runner time,
    over its steps); 0 for a report with neither."""
    report = json.loads(Path(report_path).read_text())
    if "between_steps_ms" in report:
        return report["between_steps_ms"] / 1000.0
    workload = report.get("workload") or {}
    steps = workload.get("steps") or 0
    if not steps:
        return 0.0
    return max(0.0, (workload["wall_s"] - workload["runner_s"]) / steps)


@dataclass(frozen=True)
class RooflineCost:
    """max(bytes / bandwidth, flops / peak) + overhead, per step."""

    bandwidth: float = 4.3e12  # bytes/s: H200 measured copy bandwidth
    peak_flops: float = 790e12  # bf16 dense matmul
    params: float = 8.0e9  # Llama-3-8B-like
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = 32 * 8 * 128 * 2 * 2  # layers * kv heads * dim * (k, v) * bf16
    overhead_s: float = 0.0015  # launches and host work per step
    label: str = "roofline (H200, 8B bf16)"

    def __call__(self, plan: StepPlan) -> float:
        kv_tokens = sum(seq.start_pos + len(seq.token_ids) for seq in plan.seqs)
        moved = self.params * self.bytes_per_param + kv_tokens * self.kv_bytes_per_token
        flops = 2.0 * self.params * plan.num_batched_tokens
        return max(moved / self.bandwidth, flops / self.peak_flops) + self.overhead_s

    def table(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> StepCosts:
        """The same model as a bucket table, for admission and target_itl_ms (each sequence
        of a bucket priced with a 512-token context)."""
        seed = {}
        for tokens, seqs in step_buckets(token_buckets, seq_buckets):
            moved = self.params * self.bytes_per_param + 512 * seqs * self.kv_bytes_per_token
            flops = 2.0 * self.params * tokens
            compute = max(moved / self.bandwidth, flops / self.peak_flops)
            seed[(tokens, seqs)] = compute + self.overhead_s
        return StepCosts(token_buckets, seq_buckets, seed)


# ---- the simulation -----------------------------------------------------------------------


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float
    steps: int
    served: dict[str, int] = field(default_factory=dict)  # tenant -> tokens computed for it
    # The same, counted only in steps in which every tenant of the workload had a request
    # waiting: the share of service while all are backlogged, what fair share is about.
    served_backlogged: dict[str, int] = field(default_factory=dict)
    deadline_misses: int = 0  # admitted requests that timed out
    within_deadline: int = 0  # completed before their deadline


def simulate(
    workload: list[SimRequest],
    config: SchedulerConfig,
    num_blocks: int,
    cost_model,
    step_costs: StepCosts | None,
    tenants: TenantPolicy | None = None,
    block_size: int = 16,
    max_steps: int = 2_000_000,
) -> SimResult:
    """Run `workload` through a real Scheduler; `step_costs` (or None) is what the scheduler
    prices admission and target_itl_ms with, `cost_model` what a step actually takes."""
    scheduler = Scheduler(config, CacheConfig(block_size, num_blocks), tenants, step_costs)
    order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_s)
    records = [
        RequestRecord(index=i, group=w.tenant, expected_output_tokens=w.max_tokens)
        for i, w in enumerate(workload)
    ]
    by_id: dict[str, int] = {}
    served: dict[str, int] = {}
    served_backlogged: dict[str, int] = {}
    all_tenants = {w.tenant for w in workload}
    now, next_arrival, steps = 0.0, 0, 0
    misses = within = 0
    while next_arrival < len(order) or scheduler.has_unfinished_requests():
        while next_arrival < len(order) and workload[order[next_arrival]].arrival_s <= now:
            index = order[next_arrival]
            next_arrival += 1
            spec, record = workload[index], records[index]
            record.start, record.prompt_tokens = spec.arrival_s, spec.prompt_tokens
            prompt = array(
                "q", (100 + (index * 7919 + k) % 30000 for k in range(spec.prompt_tokens))
            )
            request = Request(
                f"r{index}", prompt, stop=StopConditions(spec.max_tokens, 0, frozenset()),
                arrival_time=spec.arrival_s, lane=spec.lane, tenant=spec.tenant,
                deadline=None if spec.timeout is None else spec.arrival_s + spec.timeout,
            )  # fmt: skip
            try:
                scheduler.add_request(request, now=now)
            except RequestRejected as exc:
                record.error = f"rejected {exc.reason}"
                continue
            by_id[request.request_id] = index
        if not scheduler.has_unfinished_requests():
            now = max(now, workload[order[next_arrival]].arrival_s)
            continue
        plan = scheduler.schedule(now)
        for request_id in plan.finished:  # deadline expiry
            record = records[by_id.pop(request_id)]
            record.error = "timeout"
            misses += 1
        if plan.is_empty:
            if next_arrival < len(order):
                now = max(now, workload[order[next_arrival]].arrival_s)
            continue
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"the simulation did not finish in {max_steps} steps")
        seconds = cost_model(plan)
        now += seconds
        if step_costs is not None:
            step_costs.observe(plan.num_batched_tokens, len(plan.seqs), seconds)
        sampled = {seq.request_id: FILLER_TOKEN for seq in plan.seqs if seq.sample}
        backlogged = set()
        for lane in LANES:
            backlogged |= set(scheduler.waiting.tenant_queues(lane))
        for seq in plan.seqs:
            tenant = workload[by_id[seq.request_id]].tenant
            served[tenant] = served.get(tenant, 0) + len(seq.token_ids)
            if len(all_tenants) > 1 and backlogged >= all_tenants:
                served_backlogged[tenant] = served_backlogged.get(tenant, 0) + len(seq.token_ids)
        for request_id in sampled:
            record = records[by_id[request_id]]
            rel = now - record.start
            if not record.chunk_times:
                record.ttft = rel
            record.chunk_times.append(now)
            record.chunk_tokens.append(1)
            record.output_tokens += 1
        for request in scheduler.update_from_output(plan, sampled):
            index = by_id.pop(request.request_id)
            record = records[index]
            record.success = True
            record.e2e = now - record.start
            timeout = workload[index].timeout
            within += timeout is None or record.e2e <= timeout
    start = min((w.arrival_s for w in workload), default=0.0)
    duration = max(now - start, 1e-9)
    return SimResult(records, duration, steps, served, served_backlogged, misses, within)


# ---- workloads ----------------------------------------------------------------------------


def synthetic(
    num_requests: int,
    rate: float,
    prompt_len: str,
    output_len: str,
    tenant_shares: dict[str, float],
    seed: int = 0,
    lane: str = "interactive",
    timeout: float | None = None,
    timeout_fraction: float = 0.0,
) -> list[SimRequest]:
    """Poisson arrivals at `rate` req/s (inf: all at 0), tenants drawn by share."""
    rng = np.random.default_rng(seed)
    prompts = LengthDist.parse(prompt_len).sample(rng, num_requests)
    outputs = LengthDist.parse(output_len).sample(rng, num_requests)
    names = list(tenant_shares)
    weights = np.array([tenant_shares[n] for n in names], float)
    tenants = rng.choice(len(names), size=num_requests, p=weights / weights.sum())
    gaps = np.zeros(num_requests) if math.isinf(rate) else rng.exponential(1 / rate, num_requests)
    arrivals = np.cumsum(gaps) - gaps[0]
    with_deadline = rng.random(num_requests) < timeout_fraction
    return [
        SimRequest(
            float(arrivals[i]),
            prompts[i],
            outputs[i],
            names[tenants[i]],
            lane,
            timeout if with_deadline[i] else None,
        )
        for i in range(num_requests)
    ]


def load_jsonl(path: str) -> list[SimRequest]:
    out = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            out.append(
                SimRequest(
                    float(row["arrival_s"]),
                    int(row["prompt_tokens"]),
                    int(row["max_tokens"]),
                    str(row.get("tenant", "default")),
                    str(row.get("lane", "interactive")),
                    None if row.get("timeout") is None else float(row["timeout"]),
                )
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{number}: {type(exc).__name__}: {exc}") from None
    return out


# ---- reporting ----------------------------------------------------------------------------


def tenant_figures(result: SimResult) -> dict[str, dict]:
    """Per tenant: share of the tokens served while every tenant was backlogged, TTFT p99
    (ms), output tokens/s."""
    total = sum(result.served_backlogged.values()) or 1
    figures = {}
    for tenant in sorted({r.group for r in result.records}):
        ok = [r for r in result.records if r.group == tenant and r.success]
        ttfts = [r.ttft * 1000 for r in ok]
        figures[tenant] = {
            "served_share": result.served_backlogged.get(tenant, 0) / total,
            "ttft_p99_ms": float(np.percentile(ttfts, 99)) if ttfts else None,
            "output_tok_s": sum(r.output_tokens for r in ok) / result.duration,
        }
    return figures


def report(result: SimResult, title: str, slo: dict, per_tenant: bool = True) -> str:
    summary = summarize(result.records, result.duration, **slo)
    lines = [format_summary(summary, f"{title} [simulated]")]
    if per_tenant:
        for group, sub in summarize_by_group(result.records, result.duration, **slo).items():
            lines.append(format_summary(sub, f"{title} [simulated]: tenant {group}"))
    return "\n".join(lines)


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in rows
    )


def _fmt(value: float | None, spec: str = ".1f") -> str:
    return "-" if value is None else format(value, spec)


# ---- presets ------------------------------------------------------------------------------


def _engine_config(**overrides) -> SchedulerConfig:
    base = {"max_num_seqs": 32, "max_num_batched_tokens": 512, "max_model_len": 2048}
    return SchedulerConfig(**{**base, **overrides})


def _measured(report_path: str) -> tuple[StepCosts, MeasuredCost]:
    token_buckets, seq_buckets = engine_buckets(512, 32, decode_midpoints=True)  # a CPU's
    model = MeasuredCost.from_report(report_path, token_buckets, seq_buckets)

    def fresh() -> StepCosts:
        return StepCosts(token_buckets, seq_buckets, dict(model.costs.seconds))

    return fresh, model


def _models(args) -> list[tuple[str, object, object]]:
    """(label, cost model, factory of the scheduler's StepCosts) for each cost model."""
    fresh, measured = _measured(args.bucket_report)
    roofline = RooflineCost()
    token_buckets, seq_buckets = make_token_buckets(512, smallest=1), make_seq_buckets(32)
    return [
        ("measured (CPU table)", measured, fresh),
        (roofline.label, roofline, lambda: roofline.table(token_buckets, seq_buckets)),
    ]


def preset_fairness(args) -> str:
    """Tenants A and B both backlogged, A sending 4x B's requests: FCFS vs fair share."""
    out = []
    for label, model, costs in _models(args):
        rate = args.rate or (6.0 if "CPU" in label else 400.0)
        workload = synthetic(args.num_requests or 200, rate, "uniform:64:256", "uniform:32:96",
                             {"A": 4.0, "B": 1.0}, args.seed)  # fmt: skip
        rows = [["policy", "B share*", "A share*", "B TTFT p99 ms", "A TTFT p99 ms", "A tok/s"]]
        for policy in ("fcfs", "vtc"):
            result = simulate(workload, _engine_config(fairness=policy), 4096, model, costs())
            t = tenant_figures(result)
            rows.append([
                policy, _fmt(t["B"]["served_share"], ".1%"), _fmt(t["A"]["served_share"], ".1%"),
                _fmt(t["B"]["ttft_p99_ms"]), _fmt(t["A"]["ttft_p99_ms"]),
                _fmt(t["A"]["output_tok_s"]),
            ])  # fmt: skip
        out.append(f"== fairness, {label} [simulated], {rate:g} req/s, A:B = 4:1 ==")
        out.append(_table(rows))
        out.append("* share of the tokens served while both tenants had requests waiting")
    return "\n".join(out)


def preset_deadline(args) -> str:
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
    for label, model, costs in _models(args):
        cpu = "CPU" in label
        rate = args.rate or (8.0 if cpu else 400.0)
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
            config = _engine_config(deadline_admission=admission)
            result = simulate(workload, config, 4096, model, costs())
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
        out.append(_table(rows))
        out.append("* requests done within their deadline or without one, per second of the "
                   "whole run (until the batch backlog drains)")  # fmt: skip
        out.append(f"goodput ratio (early / time out): {goodputs[1] / max(goodputs[0], 1e-9):.2f}x")
    return "\n".join(out)


def preset_adaptive(args) -> str:
    """Chunked prefill: running decodes plus long prompts; fixed largest budget vs a
    target_itl_ms that keeps decode steps under it."""
    out = []
    for label, model, costs in _models(args):
        cpu = "CPU" in label
        target = args.target_itl_ms or (450.0 if cpu else 6.0)
        decodes = [SimRequest(0.0, 32, 400 if cpu else 1900, "decode") for _ in range(8)]
        period = 4.0 if cpu else 0.05
        longs = [SimRequest(1.0 + period * i, 1536, 1, "prefill") for i in range(12)]
        rows = [["budget", "decode ITL p50 ms", "decode ITL p99 ms", "prefill tok/s"]]
        for name, target_ms in (("fixed 512", 0.0), (f"target {target:g} ms", target)):
            config = _engine_config(target_itl_ms=target_ms)
            result = simulate(decodes + longs, config, 4096, model, costs())
            itl = [g * 1000 for r in result.records if r.group == "decode" for g in r.itl]
            pre = [r for r in result.records if r.group == "prefill" and r.success]
            span = max(r.start + r.e2e for r in pre) - min(r.start for r in pre)
            rows.append([name, _fmt(float(np.percentile(itl, 50))),
                         _fmt(float(np.percentile(itl, 99))),
                         _fmt(sum(r.prompt_tokens for r in pre) / span)])  # fmt: skip
        out.append(f"== adaptive budget, {label} [simulated] ==")
        out.append(_table(rows))
    return "\n".join(out)


def preset_policies(args) -> str:
    """Static vs continuous batching vs continuous with fair share, under both cost models."""
    out = []
    for label, model, costs in _models(args):
        rate = args.rate or (4.0 if "CPU" in label else 300.0)
        workload = synthetic(args.num_requests or 200, rate, "lognormal:128:0.8:1024",
                             "lognormal:64:1.0:512", {"A": 4.0, "B": 1.0}, args.seed)  # fmt: skip
        rows = [["policy", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms"]]
        for name, overrides in (
            ("static", {"scheduling": "static", "fairness": "fcfs"}),
            ("continuous fcfs", {"fairness": "fcfs"}),
            ("continuous vtc", {"fairness": "vtc"}),
        ):
            result = simulate(workload, _engine_config(**overrides), 4096, model, costs())
            s = summarize(result.records, result.duration)
            rows.append([name, f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
                         _fmt(s["ttft_ms"]["p50"]), _fmt(s["ttft_ms"]["p99"]),
                         _fmt(s["tpot_ms"]["p50"])])  # fmt: skip
        out.append(f"== batching policies, {label} [simulated], {rate:g} req/s ==")
        out.append(_table(rows))
    return "\n".join(out)


# SmolLM2-135M's KV cache in float32 (the CPU default): 30 layers, 3 KV heads of 64, K and V.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 4


def _served_config(command: str) -> tuple[SchedulerConfig, int, int]:
    """(scheduler config, KV blocks, block size) of a `jserve serve` command line, through
    jserve's own parser so defaults cannot drift."""
    from jserve.config.engine_args import engine_args_from_namespace
    from jserve.server.cli import build_parser as serve_parser

    words = command.split()
    ns = serve_parser().parse_args(words[words.index("serve") :])
    engine = engine_args_from_namespace(ns)
    blocks = engine.num_kv_blocks or engine.kv_cache_memory // (
        SMOLLM2_KV_BYTES_PER_TOKEN * engine.block_size
    )
    return engine.scheduler_config(engine.max_model_len or 2048), blocks, engine.block_size


def compare_serve(path: str, report_path: str) -> str:
    """Predicted (measured-table cost model) vs measured, for each real-engine run in a
    bench/serve.py or bench/compare.py JSON: the same arrivals, prompt and output lengths."""
    data = json.loads(Path(path).read_text())
    runs = data.get("reports", {"run": data})
    rows = [["run", "", "req/s", "out tok/s", "TTFT p50 ms", "TPOT p50 ms", "steps",
             "ms/step"]]  # fmt: skip
    for name, run in runs.items():
        if "--mock" in run["command"]:
            continue  # a mock server's cost is not the table's
        config, blocks, block_size = _served_config(run["command"])
        workload = [
            SimRequest(r["start"], r["prompt_tokens"], r["expected_output_tokens"])
            for r in run["requests"]
        ]
        token_buckets, seq_buckets = engine_buckets(  # as the CPU engine that ran it
            config.max_num_batched_tokens, config.max_num_seqs, decode_midpoints=True
        )
        model = MeasuredCost.from_report(report_path, token_buckets, seq_buckets)
        costs = StepCosts(token_buckets, seq_buckets, dict(model.costs.seconds))
        result = simulate(workload, config, blocks, model, costs, None, block_size)
        measured, predicted = run["summary"], summarize(result.records, result.duration)
        # Steps, and the run's duration over them: the server's step count (bench/serve.py
        # reads it from /metrics) for the measured run, the simulated steps for the other.
        predicted["engine_steps"] = result.steps
        predicted["wall_ms_per_step"] = 1000.0 * result.duration / max(result.steps, 1)
        for label, s in (("measured", measured), ("simulated", predicted)):
            rows.append([name, label, f"{s['request_throughput']:.3f}",
                         f"{s['output_throughput']:.1f}", _fmt(s["ttft_ms"]["p50"]),
                         _fmt(s["tpot_ms"]["p50"]), str(s.get("engine_steps", "-")),
                         _fmt(s.get("wall_ms_per_step"))])  # fmt: skip
        ratio = [
            predicted["request_throughput"] / measured["request_throughput"],
            predicted["output_throughput"] / measured["output_throughput"],
            (predicted["ttft_ms"]["p50"] or 0) / (measured["ttft_ms"]["p50"] or 1),
            (predicted["tpot_ms"]["p50"] or 0) / (measured["tpot_ms"]["p50"] or 1),
            predicted["engine_steps"] / (measured.get("engine_steps") or float("nan")),
            predicted["wall_ms_per_step"] / (measured.get("wall_ms_per_step") or float("nan")),
        ]
        rows.append([name, "sim/measured", *(f"{x:.2f}" for x in ratio)])
    load = {n: r.get("loadavg_1min") for n, r in runs.items()}
    return "\n".join([f"== simulator vs measured: {path} ==", _table(rows),
                      f"measured runs' 1-minute load (before/after): {load}"])  # fmt: skip


PRESETS = {
    "fairness": preset_fairness,
    "deadline": preset_deadline,
    "adaptive": preset_adaptive,
    "policies": preset_policies,
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=[*PRESETS, "all"], default=None)
    parser.add_argument(
        "--compare-serve", nargs="+", default=None, metavar="JSON",
        help="bench/serve.py or bench/compare.py results: simulate the same workloads and "
        "print predicted vs measured",
    )  # fmt: skip
    parser.add_argument("--bucket-report", default=str(DEFAULT_REPORT))
    parser.add_argument("--cost-model", choices=["measured", "roofline"], default="measured")
    parser.add_argument("--dataset", default=None, help="JSONL workload (see the docstring)")
    parser.add_argument(
        "--num-requests", type=int, default=None, help="default: per preset, else 200"
    )
    parser.add_argument("--rate", type=float, default=None, help="req/s (default: per preset)")
    parser.add_argument("--prompt-len", default="lognormal:128:0.8:1024")
    parser.add_argument("--output-len", default="lognormal:64:1.0:512")
    parser.add_argument("--tenants", default="default:1", help="NAME:SHARE,... of requests")
    parser.add_argument("--fairness", choices=["vtc", "fcfs"], default="vtc")
    parser.add_argument("--scheduling", choices=["continuous", "static"], default="continuous")
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--num-kv-blocks", type=int, default=4096)
    parser.add_argument("--target-itl-ms", type=float, default=0.0)
    parser.add_argument("--slo-ttft", type=float, default=None)
    parser.add_argument("--slo-tpot", type=float, default=None)
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.compare_serve:
        print("\n\n".join(compare_serve(p, args.bucket_report) for p in args.compare_serve))
        return 0
    if args.preset:
        names = list(PRESETS) if args.preset == "all" else [args.preset]
        print("\n\n".join(PRESETS[name](args) for name in names))
        return 0
    if args.dataset:
        workload = load_jsonl(args.dataset)
    else:
        shares = {}
        for item in args.tenants.split(","):
            name, _, share = item.partition(":")
            shares[name] = float(share or 1)
        rate = float("inf") if args.rate is None else args.rate
        num_requests = args.num_requests or 200
        workload = synthetic(num_requests, rate, args.prompt_len, args.output_len, shares,
                             args.seed)  # fmt: skip
    token_buckets, seq_buckets = engine_buckets(  # as a CPU engine has them
        args.max_num_batched_tokens, args.max_num_seqs, args.cost_model == "measured"
    )
    if args.cost_model == "measured":
        model = MeasuredCost.from_report(args.bucket_report, token_buckets, seq_buckets)
        costs = StepCosts(token_buckets, seq_buckets, dict(model.costs.seconds))
    else:
        model = RooflineCost()
        costs = model.table(token_buckets, seq_buckets)
    config = SchedulerConfig(
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=2048, fairness=args.fairness, scheduling=args.scheduling,
        target_itl_ms=args.target_itl_ms,
    )  # fmt: skip
    result = simulate(workload, config, args.num_kv_blocks, model, costs)
    slo = {"slo_ttft_ms": args.slo_ttft, "slo_tpot_ms": args.slo_tpot}
    print(report(result, f"{args.cost_model} cost model, {len(workload)} requests", slo))
    return 0


if __name__ == "__main__":
    sys.exit(main())
