"""Side-by-side serving comparisons of jserve configurations, one invocation each.

    python -m bench.serve_compare static-vs-continuous  # throughput ratio (goal >= 2x)
    python -m bench.serve_compare prefix-cache          # TTFT ratio on a shared prefix (>= 3x)
    python -m bench.serve_compare chunked-prefill       # decode ITL p99 while long prompts arrive
    python -m bench.serve_compare latency-vs-load --rates 0.25,0.5,1,2,inf
    python -m bench.serve_compare router                # routing policies over 2 replicas
    python -m bench.serve_compare all --smoke           # every preset on mock servers, seconds

For a preset (bench.serve_presets), through the A/B driver (bench.ab_driver): start `jserve
serve` with config A on a free loopback port, run the preset's workload with bench.serve's
core, stop the server (SIGTERM), then the same for config B, and print a table of both sides
with the gain of B over A (B/A for throughputs, A/B for latencies, so > 1 always means B is
better). Writes serve_PRESET.json and serve_PRESET_LABEL.png under --out, and each server's
learned step costs as serve_PRESET_LABEL_step_costs.json. `--server-args "..."` is added to
both sides' command lines (e.g. a --model).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

from bench.ab_driver import alternate, describe
from bench.load_curve import add_curve_arguments, run_latency_vs_load
from bench.report_writer import RESULTS_DIR, fmt, text_table, write_json
from bench.router_bench import run_router_preset
from bench.serve import benchmark, first_model
from bench.serve_client import LoadConfig
from bench.serve_plot import plot_run
from bench.serve_presets import PRESETS, ROUTER_PRESETS, Preset
from bench.server_process import ServerProcess, jserve_command, mock_command
from bench.workloads import preset_workload, workload_digest
from jserve.simulate.metrics import format_summary

# (label, summary key, stat, higher is better)
TABLE_ROWS = [
    ("requests/s", "request_throughput", None, True),
    ("output tokens/s", "output_throughput", None, True),
    ("total tokens/s", "total_token_throughput", None, True),
    ("TTFT mean (ms)", "ttft_ms", "mean", False),
    ("TTFT p50 (ms)", "ttft_ms", "p50", False),
    ("TTFT p99 (ms)", "ttft_ms", "p99", False),
    ("TPOT p50 (ms)", "tpot_ms", "p50", False),
    ("TPOT p99 (ms)", "tpot_ms", "p99", False),
    ("ITL p50 (ms)", "itl_ms", "p50", False),
    ("ITL p99 (ms)", "itl_ms", "p99", False),
    ("E2E p50 (ms)", "e2e_ms", "p50", False),
    ("E2E p99 (ms)", "e2e_ms", "p99", False),
    ("engine steps", "engine_steps", None, False),
    ("tokens per step", "tokens_per_step", None, True),
    ("wall ms per step", "wall_ms_per_step", None, False),
    ("server CPU ms per token", "server_cpu_ms_per_token", None, False),
]


def gain(a: float | None, b: float | None, higher_is_better: bool) -> float | None:
    if a is None or b is None or min(a, b) <= 0:
        return None
    return b / a if higher_is_better else a / b


def shares_while_all_wait(records: list) -> dict[str, float] | None:
    """Each group's share of the tokens served while every group had a request waiting for
    its first token (None with fewer than two groups, or no such time): a client's view of
    fair share while all are backlogged, since it cannot see the server's queues. A request
    counts as waiting from its send to its first token; its prompt tokens are served at its
    first token, its output tokens as they stream."""
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return None
    events = []  # (time, group, +1 starts waiting / -1 stops)
    tokens = []  # (time, group, count)
    for r in records:
        if not r.success or not r.chunk_times:
            continue
        first = r.start + r.ttft
        events += [(r.start, r.group, 1), (first, r.group, -1)]
        tokens.append((first, r.group, r.prompt_tokens))
        tokens += [(t, r.group, n) for t, n in zip(r.chunk_times, r.chunk_tokens, strict=True)]
    waiting = dict.fromkeys(groups, 0)
    windows, opened = [], None
    for time, group, step in sorted(events, key=lambda e: (e[0], -e[2])):
        waiting[group] += step
        if opened is None and all(waiting.values()):
            opened = time
        elif opened is not None and not all(waiting.values()):
            windows.append((opened, time))
            opened = None
    served = dict.fromkeys(groups, 0)
    for time, group, count in tokens:
        if any(a <= time <= b for a, b in windows):
            served[group] += count
    total = sum(served.values())
    return {g: served[g] / total for g in groups} if total else None


def ratio_table(preset: Preset, reports: dict[str, dict]) -> tuple[str, list[dict]]:
    """The printed table and its rows (for the JSON)."""
    a, b = reports[preset.a.label], reports[preset.b.label]
    scopes = [("", None)] + [(f"[{g}] ", g) for g in sorted(a["groups"])]
    rows = []
    for prefix, group in scopes:
        for label, key, stat, higher in TABLE_ROWS:
            values = []
            for report in (a, b):
                summary = report["groups"][group] if group else report["summary"]
                values.append(summary[key][stat] if stat else summary.get(key))
            if values == [None, None]:  # e.g. server-side step counts of a group
                continue
            rows.append({"metric": prefix + label, "a": values[0], "b": values[1],
                         "gain": gain(values[0], values[1], higher)})  # fmt: skip
        shares = [(report.get("shares_while_all_wait") or {}).get(group) for report in (a, b)]
        if group and shares != [None, None]:
            rows.append({"metric": prefix + "token share while all groups wait", "a": shares[0],
                         "b": shares[1], "gain": None})  # fmt: skip
    cells = [[r["metric"], fmt(r["a"], ".2f"), fmt(r["b"], ".2f"),
              "-" if r["gain"] is None else f"{r['gain']:.2f}x"] for r in rows]  # fmt: skip
    header = ["metric", preset.a.label, preset.b.label, "gain of B"]
    return text_table([header, *cells], align="lrrr", rule=True), rows


def run_side(preset: Preset, side_index: int, args: argparse.Namespace, out: Path) -> dict:
    side = (preset.a, preset.b)[side_index]
    extra = shlex.split(args.server_args)
    name = f"serve_{preset.name}_{side.label}"
    if args.smoke:
        command = mock_command([*side.mock_args, *extra])
    else:
        # The server writes the step costs it learned while serving at shutdown: a table
        # measured under the run's real load, for `jserve simulate --bucket-report`.
        costs = out / f"{name}_step_costs.json"
        command = jserve_command([*preset.extra_server_args, *side.server_args, *extra,
                                  "--save-step-costs", str(costs)])  # fmt: skip
    print(f"\n### {preset.name} / {side.label}: {shlex.join(command)}", flush=True)
    log_path = out / "logs" / f"{name}.log"
    with ServerProcess(command, log_path, start_timeout=args.start_timeout) as server:
        print(f"ready in {server.startup_s:.1f} s at {server.base_url}", flush=True)

        async def go() -> tuple:
            specs = await preset_workload(
                preset.build, server.base_url, args.seed, args.seed, args.smoke
            )
            config = LoadConfig(
                base_url=server.base_url,
                model=await first_model(server.base_url),
                max_concurrency=preset.max_concurrency,
                request_timeout=args.request_timeout,
                max_duration=args.max_duration,
                seed=args.seed,
            )
            pid = server.process.pid if server.process else None
            return specs, *await benchmark(
                config, specs, show_progress=args.progress, server_pid=pid
            )

        specs, report, records, duration = asyncio.run(go())
    report.update(command=shlex.join(command), startup_s=server.startup_s,
                  workload_digest=workload_digest(specs),
                  shares_while_all_wait=shares_while_all_wait(records))  # fmt: skip
    print(format_summary(report["summary"], f"{preset.name} / {side.label}"))
    plot_run(records, duration, out / f"{name}.png", title=f"{name}: {shlex.join(command[3:])}")
    return report


def run_preset(preset: Preset, args: argparse.Namespace, out: Path) -> dict:
    headline = preset.headline

    def headline_gain(a: dict, b: dict) -> float | None:
        return gain(headline.value(a), headline.value(b), headline.higher_is_better)

    sides = alternate(*(lambda i=i: run_side(preset, i, args, out) for i in (0, 1)), pairs=1)
    reports = {preset.a.label: sides.a[0], preset.b.label: sides.b[0]}
    table, rows = ratio_table(preset, reports)
    a_value, b_value = (headline.value(reports[s.label]) for s in (preset.a, preset.b))
    ab = sides.summary(headline_gain)
    headline_gain_value = ab["ratio"]["median"]
    verdict = (
        "n/a"
        if headline_gain_value is None
        else ("met" if headline_gain_value >= headline.goal else "NOT met")
    )
    print(f"\n==== {preset.name}: {preset.description}")
    print(table)
    print(
        f"headline: {headline.describe()} gain {describe(ab['ratio'])} (goal >= "
        f"{headline.goal}x: {verdict}); 1-minute load {sides.load_before:.2f} -> "
        f"{sides.load_after:.2f}{' [smoke: mock servers]' if args.smoke else ''}"
    )
    result = {
        "preset": preset.name,
        "description": preset.description,
        "smoke": args.smoke,
        "sides": {"a": preset.a.label, "b": preset.b.label},
        "headline": {"metric": headline.describe(), "a": a_value, "b": b_value,
                     "gain": headline_gain_value, "goal": headline.goal, "verdict": verdict},
        "ab": ab,
        "table": rows,
        "reports": reports,
    }  # fmt: skip
    write_json(out / f"serve_{preset.name}.json", result)
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=[*PRESETS, *ROUTER_PRESETS, "latency-vs-load", "all"])
    parser.add_argument("--out", default=str(RESULTS_DIR), help="directory for JSON and PNG")
    parser.add_argument("--smoke", action="store_true", help="mock servers, tiny workloads")
    parser.add_argument("--server-args", default="", help="added to every server command line")
    parser.add_argument("--start-timeout", type=float, default=600.0, help="seconds to /health")
    parser.add_argument("--request-timeout", type=float, default=600.0)
    parser.add_argument("--max-duration", type=float, default=900.0, help="seconds per run")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    add_curve_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    modes = [*PRESETS, "latency-vs-load"] if args.mode == "all" else [args.mode]
    try:
        for mode in modes:
            if mode == "latency-vs-load":
                run_latency_vs_load(args, out)
            elif mode in ROUTER_PRESETS:
                run_router_preset(ROUTER_PRESETS[mode], args, out)
            else:
                run_preset(PRESETS[mode], args, out)
    except (RuntimeError, ValueError) as exc:
        print(f"bench.serve_compare: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
