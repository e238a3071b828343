"""The one A/B driver: run A and B alternately in one process, pair by pair, and report.

A shared machine's state drifts (other processes come and go, caches warm, clocks throttle):
alternating the two sides makes that drift hit both alike, and a ratio taken within each pair
is compared with the other pairs' instead of one number standing for all. The 1-minute load
average before the first pair and after the last is recorded with the result, so a reader can
tell a quiet run from a loud one. With `abba`, every other pair runs B first (A B B A ...), so
a trend over the run cancels out of the totals too.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass
class Alternation:
    """What `alternate` ran: each side's result, pair by pair, and the load around them."""

    a: list[Any]
    b: list[Any]
    load_before: float
    load_after: float
    abba: bool

    @property
    def loadavg_1min(self) -> dict[str, float]:
        return {"before": self.load_before, "after": self.load_after}

    def ratios(self, ratio: Callable[[Any, Any], float | None]) -> list[float | None]:
        """`ratio(a, b)` of every pair (None where the pair gives none, e.g. a loud run)."""
        return [ratio(a, b) for a, b in zip(self.a, self.b, strict=True)]

    def summary(self, ratio: Callable[[Any, Any], float | None]) -> dict:
        """The record a report keeps: pairs, order, load before and after, ratio statistics."""
        return {
            "pairs": len(self.a),
            "order": "ABBA" if self.abba else "AB",
            "loadavg_1min": self.loadavg_1min,
            "ratio": ratio_stats(self.ratios(ratio)),
        }


def alternate(
    run_a: Callable[[], Any],
    run_b: Callable[[], Any],
    pairs: int | Callable[[], bool],
    *,
    abba: bool = False,
    after_pair: Callable[[int, Any, Any], None] | None = None,
) -> Alternation:
    """Run A then B (B then A on odd pairs with `abba`), `pairs` times, or while `pairs()`
    says another pair is due; `after_pair(index, a, b)` sees each pair as it ends."""
    if isinstance(pairs, int) and pairs < 1:
        raise ValueError(f"an A/B comparison needs at least one pair, got {pairs}")
    a_results: list[Any] = []
    b_results: list[Any] = []
    load_before = os.getloadavg()[0]
    while pairs() if callable(pairs) else len(a_results) < pairs:
        if abba and len(a_results) % 2:
            b = run_b()
            a = run_a()
        else:
            a = run_a()
            b = run_b()
        a_results.append(a)
        b_results.append(b)
        if after_pair is not None:
            after_pair(len(a_results) - 1, a, b)
    return Alternation(a_results, b_results, load_before, os.getloadavg()[0], abba)


def ratio_stats(ratios: Sequence[float | None]) -> dict:
    """Each pair's ratio, and the min, median and max of those that exist (None if none)."""
    kept = [r for r in ratios if r is not None]
    stats = {"ratios": list(ratios), "n": len(kept), "of": len(ratios)}
    if not kept:
        return {**stats, "min": None, "median": None, "max": None}
    return {**stats, "min": min(kept), "median": statistics.median(kept), "max": max(kept)}


def describe(stats: dict, unit: str = "x") -> str:
    """The median, the range and how many pairs gave one: "1.20x (0.90-1.25, 3 of 3 pairs)"."""
    if stats["median"] is None:
        return f"- (0 of {stats['of']} pairs)"
    return (
        f"{stats['median']:.2f}{unit} ({stats['min']:.2f}-{stats['max']:.2f}, "
        f"{stats['n']} of {stats['of']} pairs)"
    )
