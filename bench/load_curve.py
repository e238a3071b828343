"""Latency against load: one jserve server, the same workload at several Poisson request rates.

For each offered rate: achieved requests/s and output tokens/s, p50/p99 TTFT and TPOT. The knee
is the highest offered rate whose p99 TTFT stays within `KNEE_FACTOR` times the lowest p99 TTFT
of the sweep; past it, requests queue. (The lowest, not the lightest load's: on a shared
machine one noisy light-load point must not move the knee. Achieved req/s is no test of keeping
up with a few dozen requests: the run's duration includes the last request's own latency.)
Writes serve_latency_vs_load.json and .png (p99 TTFT and TPOT per rate, knee marked).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
from pathlib import Path

import aiohttp

from bench.report_writer import figure, write_json
from bench.serve import benchmark, first_model
from bench.serve_client import LoadConfig
from bench.server_process import ServerProcess, jserve_command, mock_command
from bench.workloads import (
    LATENCY_CURVE,
    LATENCY_CURVE_SMOKE,
    add_workload_arguments,
    build_workload,
)

KNEE_FACTOR = 2.0


def add_curve_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("latency-vs-load")
    group.add_argument("--rates", default="0.5,1,2,3,4,inf", help="comma-separated req/s")
    add_workload_arguments(parser)
    parser.set_defaults(**LATENCY_CURVE)


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",")]
    except ValueError:
        raise ValueError(f"--rates must be comma-separated numbers or inf, got {text!r}") from None
    if not rates or min(rates) <= 0 or rates != sorted(rates):
        raise ValueError(f"--rates must be positive and increasing, got {text!r}")
    return rates


def find_knee(points: list[dict]) -> float | None:
    """The offered rate of the knee (see the module docstring); None if no rate finished."""
    measured = [p for p in points if p["ttft_p99_ms"] is not None]
    if not measured:
        return None
    limit = KNEE_FACTOR * min(p["ttft_p99_ms"] for p in measured)
    return max(p["rate"] for p in measured if p["ttft_p99_ms"] <= limit)


def plot_curve(points: list[dict], knee: float | None, path: Path, title: str) -> None:
    x = list(range(len(points)))
    labels = [f"{p['rate']:g}\n({p['achieved_rps']:.2f})" for p in points]
    with figure(path, 2, figsize=(11, 3.8), title=title) as (_, axes):
        for ax, metric in zip(axes, ("ttft", "tpot"), strict=True):
            ax.plot(x, [p[f"{metric}_p99_ms"] for p in points], "o-", label="p99")
            ax.plot(x, [p[f"{metric}_p50_ms"] for p in points], "s--", alpha=0.6, label="p50")
            if knee is not None:
                at = [p["rate"] for p in points].index(knee)
                ax.axvline(at, color="tab:red", ls=":", label=f"knee ({knee:g} req/s)")
            ax.set_xticks(x, labels, fontsize=8)
            ax.set(xlabel="offered req/s (achieved)", ylabel="ms", title=metric.upper())
            ax.set_yscale("log")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)


def run_latency_vs_load(args: argparse.Namespace, out: Path) -> dict:
    rates = parse_rates(args.rates)
    extra = shlex.split(args.server_args)
    command = mock_command(extra) if args.smoke else jserve_command(extra)
    if args.smoke:
        vars(args).update(LATENCY_CURVE_SMOKE)
        rates = [16.0, 64.0, float("inf")]
    print(f"\n### latency-vs-load: {shlex.join(command)}", flush=True)
    with ServerProcess(command, out / "logs" / "serve_latency_vs_load.log",
                       start_timeout=args.start_timeout) as server:  # fmt: skip

        async def sweep() -> list[dict]:
            model = await first_model(server.base_url)
            points = []
            for i, rate in enumerate(rates):
                # Fresh prompts per rate: repeats would hit the prefix cache filled by the last.
                rate_args = argparse.Namespace(**{**vars(args), "seed": args.seed + i})
                async with aiohttp.ClientSession() as session:
                    specs, _ = await build_workload(rate_args, session, server.base_url)
                config = LoadConfig(server.base_url, model, request_rate=rate,
                                    request_timeout=args.request_timeout,
                                    max_duration=args.max_duration, seed=args.seed)  # fmt: skip
                report, _, _ = await benchmark(config, specs, show_progress=args.progress)
                s = report["summary"]
                latencies = {f"{m}_{q}_ms": s[f"{m}_ms"][q]
                             for m in ("ttft", "tpot") for q in ("p50", "p99")}  # fmt: skip
                points.append({"rate": rate, "achieved_rps": s["request_throughput"],
                               "output_throughput": s["output_throughput"],
                               "failed": s["failed"], **latencies})  # fmt: skip
                print(f"rate {rate:>6g} req/s: achieved {s['request_throughput']:.3f} req/s, "
                      f"{s['output_throughput']:.1f} out tok/s, TTFT p99 "
                      f"{s['ttft_ms']['p99']:.0f} ms, TPOT p99 {s['tpot_ms']['p99']:.1f} ms, "
                      f"failed {s['failed']}", flush=True)  # fmt: skip
            return points

        points = asyncio.run(sweep())
    knee = find_knee(points)
    rule = f"the highest rate with p99 TTFT within {KNEE_FACTOR:g}x of the sweep's lowest"
    print(f"knee: {'none (no rate finished a request)' if knee is None else f'{knee:g} req/s'} "
          f"({rule})")  # fmt: skip
    result = {"command": shlex.join(command), "smoke": args.smoke, "startup_s": server.startup_s,
              "workload": {"num_requests": args.num_requests, "prompt_len": args.prompt_len,
                           "output_len": args.output_len, "seed": args.seed},
              "points": points, "knee_rate": knee, "knee_factor": KNEE_FACTOR}  # fmt: skip
    write_json(out / "serve_latency_vs_load.json", result)
    title = f"latency vs load: {shlex.join(command[3:])}; {args.num_requests} requests per rate"
    plot_curve(points, knee, out / "serve_latency_vs_load.png", title)
    return result
