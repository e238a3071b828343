"""The picture of a serving run: latency CDFs and throughput over time, in one small PNG.

The figures themselves (TTFT, TPOT, ITL, E2E, throughputs, goodput) are defined and computed
by jserve.simulate.metrics, which the simulator shares.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from bench.report_writer import figure
from jserve.simulate.metrics import RequestRecord


def plot_run(records: list[RequestRecord], duration: float, path: Path, title: str) -> None:
    """Latency CDFs (TTFT, TPOT, ITL, E2E) and output tokens/s plus requests in flight over time,
    in one small PNG."""
    ok = [r for r in records if r.success]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [t for r in ok if (t := r.tpot) is not None],
        "ITL": [g for r in ok for g in r.itl],
        "E2E": [r.e2e for r in ok],
    }
    with figure(path, 5, figsize=(17, 3.4), title=title) as (_, axes):
        for ax, (name, values) in zip(axes, series.items(), strict=False):
            _cdf(ax, name, values)
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


def _cdf(ax, name: str, values: list[float]) -> None:
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
