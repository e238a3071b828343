"""The one way a benchmark writes its report: tables as Markdown or aligned text, JSON, plots.

Cells are the caller's strings (each script formats its own figures); the writer lays them
out. JSON is strict (infinite rates are written as "inf") and every file goes where it is
asked, its folder made first; scripts default to bench/results/.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from jserve.simulate.report import fmt, text_table

RESULTS_DIR = Path("bench/results")  # from the repository root, where `python -m bench.X` runs

__all__ = [
    "RESULTS_DIR", "figure", "fmt", "markdown_table", "text_table", "to_json", "write_json",
    "write_text",
]  # fmt: skip


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None
) -> str:
    """A Markdown table; `align` has one letter a column, "l" or "r" (default: all "l")."""
    align = align or "l" * len(header)
    if len(align) != len(header) or any(len(row) != len(header) for row in rows):
        raise ValueError(f"a table of {len(header)} columns got rows {rows!r} or align {align!r}")
    rule = "|" + "|".join("---:" if a == "r" else "---" for a in align) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def to_json(obj: object) -> str:
    """JSON text with infinite floats written as the string "inf" (strict JSON has none)."""

    def clean(value: object) -> object:
        if isinstance(value, float) and math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [clean(v) for v in value]
        return value

    return json.dumps(clean(obj), indent=1, allow_nan=False) + "\n"


def write_json(path: str | Path, obj: object) -> Path:
    return write_text(path, to_json(obj))


def write_text(path: str | Path, text: str) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text if text.endswith("\n") else text + "\n")
    return path


@contextlib.contextmanager
def figure(
    path: str | Path, ncols: int = 1, *, figsize: tuple[float, float], dpi: int = 70,
    title: str | None = None, layout: str = "tight", **subplots: Any,
) -> Iterator[tuple[Any, Any]]:  # fmt: skip
    """`with figure(path, 3, figsize=...) as (fig, axes):` draw, and it is saved as a small PNG
    (matplotlib's Agg backend, no display needed) and closed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    constrained = layout == "constrained"
    fig, axes = plt.subplots(
        1, ncols, figsize=figsize, layout="constrained" if constrained else None, **subplots
    )
    try:
        yield fig, axes
        if title:
            fig.suptitle(title, fontsize=9)
        if not constrained:
            fig.tight_layout()
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)
