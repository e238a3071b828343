"""Summaries and plots of a serving run's `RequestRecord`s.

Definitions (as in vLLM's benchmark_serving):
- TTFT: request start to its first text chunk. E2E: request start to the end of its stream.
- TPOT: per request, (E2E - TTFT) / (output tokens - 1); requests with one token are skipped.
- ITL: every gap between consecutive text chunks of a request, pooled over requests.
- Throughputs divide by the wall duration of the whole run, successful requests only.
- Goodput: successful requests per second whose TTFT and TPOT are within the SLOs given.
Latencies are reported in milliseconds.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
from serve_client import RequestRecord

PERCENTILES = (50, 90, 99)


def latency_stats(values_s: list[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99 and max in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, **{f"p{p}": None for p in PERCENTILES}, "max": None}
    ms = np.asarray(values_s) * 1000.0
    stats = {"mean": float(ms.mean())}
    stats.update({f"p{p}": float(np.percentile(ms, p)) for p in PERCENTILES})
    stats["max"] = float(ms.max())
    return stats


def summarize(
    records: list[RequestRecord],
    duration: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> dict:
    """The run's figures: counts, throughputs, latency stats, goodput, failure reasons."""
    ok = [r for r in records if r.success]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot) is not None]

    def meets_slo(r: RequestRecord) -> bool:
        ttft_ok = slo_ttft_ms is None or r.ttft * 1000 <= slo_ttft_ms
        tpot = r.tpot
        tpot_ok = slo_tpot_ms is None or tpot is None or tpot * 1000 <= slo_tpot_ms
        return ttft_ok and tpot_ok

    good = sum(1 for r in ok if meets_slo(r))
    errors = Counter(r.error.split(":")[0] for r in records if not r.success)
    return {
        "num_requests": len(records),
        "completed": len(ok),
        "failed": len(records) - len(ok),
        "failure_reasons": dict(errors),
        "output_len_mismatches": sum(1 for r in ok if r.output_tokens != r.expected_output_tokens),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration,
        "slo_ttft_ms": slo_ttft_ms,
        "slo_tpot_ms": slo_tpot_ms,
        "goodput": good / duration,
        "goodput_fraction": good / len(records),
        "ttft_ms": latency_stats([r.ttft for r in ok]),
        "tpot_ms": latency_stats(tpots),
        "itl_ms": latency_stats([gap for r in ok for gap in r.itl]),
        "e2e_ms": latency_stats([r.e2e for r in ok]),
    }


def summarize_by_group(records: list[RequestRecord], duration: float, **slo: float | None) -> dict:
    groups = sorted({r.group for r in records})
    if len(groups) < 2:
        return {}
    return {g: summarize([r for r in records if r.group == g], duration, **slo) for g in groups}


def format_summary(summary: dict, title: str) -> str:
    lines = [f"==== {title} ====".ljust(60, "=")]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<38} {value}")

    row("Requests completed / failed", f"{summary['completed']} / {summary['failed']}")
    for reason, count in summary["failure_reasons"].items():
        row(f"  failed: {reason}", count)
    if summary["output_len_mismatches"]:
        row("Output lengths != max_tokens", summary["output_len_mismatches"])
    row("Duration (s)", f"{summary['duration_s']:.2f}")
    row("Prompt / output tokens", f"{summary['prompt_tokens']} / {summary['output_tokens']}")
    row("Request throughput (req/s)", f"{summary['request_throughput']:.3f}")
    row("Output token throughput (tok/s)", f"{summary['output_throughput']:.2f}")
    row("Total token throughput (tok/s)", f"{summary['total_token_throughput']:.2f}")
    if summary["slo_ttft_ms"] is not None or summary["slo_tpot_ms"] is not None:
        slo = f"TTFT<={summary['slo_ttft_ms']} ms, TPOT<={summary['slo_tpot_ms']} ms"
        row(f"Goodput (req/s, {slo})", f"{summary['goodput']:.3f}")
    if summary.get("engine_steps"):
        row("Engine steps (server /metrics)", summary["engine_steps"])
        row("Tokens per step / wall ms per step",
            f"{summary['tokens_per_step']:.1f} / {summary['wall_ms_per_step']:.1f}")  # fmt: skip
    if summary.get("server_cpu_s") is not None:
        cpu, per_token = summary["server_cpu_s"], summary["server_cpu_ms_per_token"]
        row("Server CPU s / CPU ms per token", f"{cpu:.1f} / {per_token:.2f}")
    lines.append(f"{'(ms)':<10}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}{'max':>10}")
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        stats = summary[key]
        cells = "".join(
            f"{'-' if stats[s] is None else f'{stats[s]:.1f}':>10}"
            for s in ("mean", "p50", "p90", "p99", "max")
        )
        lines.append(f"{key[:-3].upper():<10}{cells}")
    return "\n".join(lines)


def plot_run(records: list[RequestRecord], duration: float, path: Path, title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens/s plus requests in flight over time,
    in one small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [t for r in ok if (t := r.tpot) is not None],
        "ITL": [g for r in ok for g in r.itl],
        "E2E": [r.e2e for r in ok],
    }
    fig, axes = plt.subplots(1, 5, figsize=(17, 3.4))
    for ax, (name, values) in zip(axes, series.items(), strict=False):
        unit, scale = "ms", 1000.0
        if values:
            if max(values) > 10.0:  # long runs read better in seconds
                unit, scale = "s", 1.0
            sorted_values = np.sort(np.asarray(values) * scale)
            ax.plot(sorted_values, np.arange(1, len(sorted_values) + 1) / len(sorted_values))
            p99 = np.percentile(sorted_values, 99)
            ax.axvline(p99, color="tab:red", ls=":", lw=1, label="p99")
            ax.legend(loc="lower right", fontsize=8)
        ax.set(title=f"{name} CDF", xlabel=unit, ylim=(0, 1.02))
        ax.grid(alpha=0.3)
    ax = axes[4]
    width = max(duration / 60.0, 0.05)  # about 60 bins whatever the run length
    edges = np.arange(0.0, duration + width, width)
    times = [t for r in ok for t in r.chunk_times]
    weights = [n for r in ok for n in r.chunk_tokens]
    tokens, _ = np.histogram(times, bins=edges, weights=weights)
    ax.stairs(tokens / width, edges, label="output tokens/s")
    in_flight = [sum(r.start <= t < r.start + r.e2e for r in ok) for t in edges[:-1]]
    twin = ax.twinx()
    twin.stairs(in_flight, edges, color="tab:orange", alpha=0.7)
    twin.set_ylabel("requests sent, not finished", color="tab:orange")
    ax.set(title="throughput over time", xlabel="s since start", ylabel="output tokens/s")
    ax.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=70)
    plt.close(fig)
