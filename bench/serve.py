"""Serving benchmark for any OpenAI-compatible endpoint (jserve, vLLM, SGLang).

    python -m bench.serve --base-url http://127.0.0.1:8000 --num-requests 64 \\
        --prompt-len lognormal:128:0.8:1024 --output-len lognormal:64:1.0:512 --out bench/results
    python -m bench.serve --base-url ... --workload shared-prefix --prefix-len 1024 \\
        --prompt-len 32 --output-len 16 --max-concurrency 4
    python -m bench.serve --base-url ... --smoke      # a tiny workload, seconds

Sends greedy requests with `ignore_eos` (and `min_tokens = max_tokens`) so output lengths are
what the workload says, streams them, and prints requests/s, tokens/s and TTFT/TPOT/ITL/E2E
statistics (jserve.simulate.metrics defines them). With --out DIR it writes NAME.json and
NAME.png (latency CDFs and throughput over time). Failed requests are counted, never fatal.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from dataclasses import asdict
from pathlib import Path

import aiohttp

from bench.report_writer import write_json
from bench.serve_client import LoadConfig, run_load
from bench.serve_plot import plot_run
from bench.server_stats import process_tree_cpu_seconds, run_stats, scrape
from bench.workloads import (
    SERVE_SMOKE,
    RequestSpec,
    add_workload_arguments,
    build_workload,
    workload_digest,
)
from jserve.simulate.metrics import RequestRecord, format_summary, summarize, summarize_by_group


async def first_model(base_url: str) -> str:
    """The first model /v1/models lists."""
    async with (
        aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session,
        session.get(base_url + "/v1/models") as resp,
    ):
        if resp.status != 200:
            raise ValueError(f"GET {base_url}/v1/models answered {resp.status}; pass --model")
        return (await resp.json())["data"][0]["id"]


async def prepare_workload(
    args: argparse.Namespace, base_url: str
) -> tuple[list[RequestSpec], dict]:
    """The workload and a description of it for the JSON report."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        specs, exact = await build_workload(args, session, base_url)
    info = {
        "kind": "dataset" if args.dataset else args.workload,
        "num_requests": len(specs),
        "prompt_len": args.prompt_len,
        "output_len": args.output_len,
        "prefix_len": args.prefix_len if args.workload == "shared-prefix" else None,
        "seed": args.seed,
        "exact_token_lengths": exact,
        "digest": workload_digest(specs),
    }
    return specs, info


def record_row(record: RequestRecord) -> dict:
    row = asdict(record)
    del row["chunk_times"], row["chunk_tokens"]
    row["num_chunks"] = len(record.chunk_times)
    return row


async def benchmark(
    config: LoadConfig,
    specs: list[RequestSpec],
    *,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
    show_progress: bool = True,
    server_pid: int | None = None,
) -> tuple[dict, list[RequestRecord], float]:
    """Run the load; returns the report (config, summary, per-group summaries, per-request
    rows), the records and the duration. With `server_pid` (a local server), the summary also
    holds the CPU seconds its process tree spent during the run."""
    load_before, metrics_before = os.getloadavg(), await scrape(config.base_url)
    cpu_before = process_tree_cpu_seconds(server_pid) if server_pid else 0.0
    records, duration = await run_load(config, specs, show_progress=show_progress)
    server = run_stats(metrics_before, await scrape(config.base_url), duration)
    slo = {"slo_ttft_ms": slo_ttft_ms, "slo_tpot_ms": slo_tpot_ms}
    summary = summarize(records, duration, **slo)
    summary.update({k: server.get(k) for k in ("engine_steps", "tokens_per_step",
                                               "wall_ms_per_step")})  # fmt: skip
    if server_pid:
        cpu = process_tree_cpu_seconds(server_pid) - cpu_before
        tokens = summary["prompt_tokens"] + summary["output_tokens"]
        summary.update(server_cpu_s=cpu, server_cpu_ms_per_token=1000.0 * cpu / max(tokens, 1))
    report = {
        "config": asdict(config),
        # Other processes on the machine skew every figure: keep the evidence with the result.
        "loadavg_1min": {"before": load_before[0], "after": os.getloadavg()[0]},
        "server_metrics_deltas": server["deltas"],
        "summary": summary,
        "groups": summarize_by_group(records, duration, **slo),
        "requests": [record_row(r) for r in records],
    }
    return report, records, duration


def write_outputs(
    report: dict, records: list[RequestRecord], duration: float, out: Path, name: str
) -> None:
    write_json(out / f"{name}.json", report)
    plot_run(records, duration, out / f"{name}.png", title=name)


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("load")
    group.add_argument("--request-rate", type=float, default=float("inf"), help="req/s (Poisson)")
    group.add_argument("--max-concurrency", type=int, default=None)
    group.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    group.add_argument(
        "--no-ignore-eos", dest="ignore_eos", action="store_false",
        help="do not send ignore_eos/min_tokens (servers that refuse them)",
    )  # fmt: skip
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
    group.add_argument("--max-duration", type=float, default=1800.0, help="seconds for the run")
    group.add_argument("--slo-ttft", type=float, default=None, help="goodput SLO, ms")
    group.add_argument("--slo-tpot", type=float, default=None, help="goodput SLO, ms")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="default: the first of /v1/models")
    parser.add_argument("--out", default=None, help="directory for NAME.json and NAME.png")
    parser.add_argument("--name", default="serve", help="file name stem under --out")
    parser.add_argument("--smoke", action="store_true", help="a tiny workload (seconds)")
    parser.add_argument(
        "--server-pid", type=int, default=None,
        help="pid of a local server: report the CPU seconds its process tree spends",
    )  # fmt: skip
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    add_workload_arguments(parser)
    add_load_arguments(parser)
    return parser


def load_config(args: argparse.Namespace, base_url: str, model: str) -> LoadConfig:
    return LoadConfig(
        base_url=base_url,
        model=model,
        endpoint=args.endpoint,
        request_rate=args.request_rate,
        max_concurrency=args.max_concurrency,
        ignore_eos=args.ignore_eos,
        request_timeout=args.request_timeout,
        max_duration=args.max_duration,
        seed=args.seed,
    )


async def main_async(args: argparse.Namespace) -> dict:
    base_url = args.base_url.rstrip("/")
    model = args.model or await first_model(base_url)
    specs, workload = await prepare_workload(args, base_url)
    config = load_config(args, base_url, model)
    report, records, duration = await benchmark(
        config, specs, slo_ttft_ms=args.slo_ttft, slo_tpot_ms=args.slo_tpot,
        show_progress=args.progress, server_pid=args.server_pid,
    )  # fmt: skip
    report = {"workload": workload, **report}
    print(format_summary(report["summary"], f"{args.name}: {model} at {base_url}"))
    for group, summary in report["groups"].items():
        print(format_summary(summary, f"group {group}"))
    if args.out:
        write_outputs(report, records, duration, Path(args.out), args.name)
        print(f"wrote {Path(args.out) / args.name}.json and .png")
    return report


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.smoke:
        for key, value in SERVE_SMOKE.items():
            setattr(args, key, value)
    try:
        report = asyncio.run(main_async(args))
    except (ValueError, aiohttp.ClientError) as exc:
        print(f"bench.serve: error: {exc}", file=sys.stderr)
        return 2
    return 0 if report["summary"]["completed"] else 1


if __name__ == "__main__":
    sys.exit(main())
