"""Side-by-side serving comparisons of jserve configurations, one invocation each.

    python bench/compare.py static-vs-continuous      # throughput ratio (goal >= 2x)
    python bench/compare.py prefix-cache              # TTFT ratio on a shared prefix (goal >= 3x)
    python bench/compare.py chunked-prefill           # decode ITL p99 while long prompts arrive
    python bench/compare.py latency-vs-load --rates 0.25,0.5,1,2,inf
    python bench/compare.py router                    # routing policies over 2 replicas
    python bench/compare.py all --smoke               # every preset on mock servers, seconds

For a preset: start `jserve serve` with config A on a free loopback port, run the preset's
workload with bench/serve.py's core, stop the server (SIGTERM), then the same for config B, and
print a table of both sides with the gain of B over A (B/A for throughputs, A/B for latencies,
so > 1 always means B is better). Writes serve_PRESET.json and serve_PRESET_LABEL.png under
--out, and each server's learned step costs as serve_PRESET_LABEL_step_costs.json. `--server-args
"..."` is added to both sides' command lines (e.g. a --model).
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
from pathlib import Path

import aiohttp
import numpy as np
from compare_presets import PRESETS, ROUTER_PRESETS, Preset
from load_curve import add_curve_arguments, run_latency_vs_load
from router_bench import run_router_preset
from serve import benchmark, first_model, to_json
from serve_client import LoadConfig
from serve_metrics import format_summary, plot_run
from server_process import ServerProcess, jserve_command, mock_command
from workloads import TextMaker, workload_digest

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
    width = max(len(r["metric"]) for r in rows) + 2
    head = f"{'metric':<{width}}{preset.a.label:>18}{preset.b.label:>18}{'gain of B':>12}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = "".join("-".rjust(18) if v is None else f"{v:18.2f}" for v in (r["a"], r["b"]))
        g = "-" if r["gain"] is None else f"{r['gain']:.2f}x"
        lines.append(f"{r['metric']:<{width}}{cells}{g:>12}")
    return "\n".join(lines), rows


async def build_specs(preset: Preset, base_url: str, seed: int, smoke: bool) -> list:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as session:
        maker = TextMaker(session, base_url, seed)
        await maker.setup()
        return await preset.build(maker, np.random.default_rng(seed), smoke)


def run_side(preset: Preset, side_index: int, args: argparse.Namespace, out: Path) -> dict:
    side = (preset.a, preset.b)[side_index]
    extra = shlex.split(args.server_args)
    name = f"serve_{preset.name}_{side.label}"
    if args.smoke:
        command = mock_command([*side.mock_args, *extra])
    else:
        # The server writes the step costs it learned while serving at shutdown: a table
        # measured under the run's real load, for bench/simulate.py --bucket-report.
        costs = out / f"{name}_step_costs.json"
        command = jserve_command([*preset.extra_server_args, *side.server_args, *extra,
                                  "--save-step-costs", str(costs)])  # fmt: skip
    print(f"\n### {preset.name} / {side.label}: {shlex.join(command)}", flush=True)
    log_path = out / "logs" / f"{name}.log"
    with ServerProcess(command, log_path, start_timeout=args.start_timeout) as server:
        print(f"ready in {server.startup_s:.1f} s at {server.base_url}", flush=True)

        async def go() -> tuple:
            specs = await build_specs(preset, server.base_url, args.seed, args.smoke)
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
    reports = {
        side.label: run_side(preset, i, args, out) for i, side in enumerate((preset.a, preset.b))
    }
    table, rows = ratio_table(preset, reports)
    headline = preset.headline
    a_value, b_value = (headline.value(reports[s.label]) for s in (preset.a, preset.b))
    headline_gain = gain(a_value, b_value, headline.higher_is_better)
    verdict = (
        "n/a" if headline_gain is None else ("met" if headline_gain >= headline.goal else "NOT met")
    )
    print(f"\n==== {preset.name}: {preset.description}")
    print(table)
    print(
        f"headline: {headline.describe()} gain {headline_gain and round(headline_gain, 2)}x "
        f"(goal >= {headline.goal}x: {verdict}){' [smoke: mock servers]' if args.smoke else ''}"
    )
    result = {
        "preset": preset.name,
        "description": preset.description,
        "smoke": args.smoke,
        "sides": {"a": preset.a.label, "b": preset.b.label},
        "headline": {"metric": headline.describe(), "a": a_value, "b": b_value,
                     "gain": headline_gain, "goal": headline.goal, "verdict": verdict},
        "table": rows,
        "reports": reports,
    }  # fmt: skip
    (out / f"serve_{preset.name}.json").write_text(to_json(result))
    return result


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("mode", choices=[*PRESETS, *ROUTER_PRESETS, "latency-vs-load", "all"])
    parser.add_argument("--out", default="bench/results", help="directory for JSON and PNG")
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
        print(f"compare.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
