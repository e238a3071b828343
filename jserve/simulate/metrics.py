"""Serving figures of a run's requests, measured (`python -m bench.serve`) or simulated alike.

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
from dataclasses import dataclass, field

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    """What one request measured. Times are seconds; `start` and `chunk_times` are offsets from
    the run's start, `ttft` and `e2e` durations from the request's own start."""

    index: int
    group: str
    expected_output_tokens: int
    success: bool = False
    error: str = ""
    start: float = 0.0
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive text chunks."""
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:], strict=False)]

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first (None with fewer than two tokens)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


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
