"""What the simulator prints: the serving table per run and tenant, and aligned text tables.

Every title says [simulated]: these figures come from a cost model, not from a machine.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from jserve.simulate.metrics import format_summary, summarize, summarize_by_group
from jserve.simulate.simulator import SimResult


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


def serving_report(result: SimResult, title: str, slo: dict, per_tenant: bool = True) -> str:
    """The serving benchmark's summary of a simulated run, overall and per tenant."""
    summary = summarize(result.records, result.duration, **slo)
    lines = [format_summary(summary, f"{title} [simulated]")]
    if per_tenant:
        for group, sub in summarize_by_group(result.records, result.duration, **slo).items():
            lines.append(format_summary(sub, f"{title} [simulated]: tenant {group}"))
    return "\n".join(lines)


def text_table(rows: Sequence[Sequence[str]], align: str | None = None, rule: bool = False) -> str:
    """Rows of cells (the first row the header) in columns as wide as their widest cell;
    `align` has one letter a column, "l" or "r" (default: all right-aligned), and `rule` draws
    a line under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    align = align or "r" * len(widths)
    lines = [
        "  ".join(
            c.ljust(w) if a == "l" else c.rjust(w)
            for c, w, a in zip(row, widths, align, strict=True)
        )
        for row in rows
    ]
    if rule:
        lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def fmt(value: float | None, spec: str = ".1f") -> str:
    """`value` formatted, or "-" for a figure that does not exist (no request finished)."""
    return "-" if value is None else format(value, spec)
