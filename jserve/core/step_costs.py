"""Measured step costs per precompiled bucket, learned online: what admission and the
adaptive token budget price steps with.

Every step runs padded to a (tokens, seqs) bucket (jserve.core.buckets), so its time depends
on the bucket, not on the exact batch. The table starts from a seed (a `bench/buckets.py`
report, or the engine's own warm timing at start-up) and each served step updates its
bucket's entry by an exponential moving average, so the estimates follow the machine's actual
load. A bucket never measured is priced from the nearest measured one, scaled by tokens.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from jserve.core.buckets import pick_step_bucket

EWMA_WEIGHT = 0.2  # weight of the newest measurement of a bucket
RECENT_WEIGHT = 0.05  # of the newest step in the load-mix average (about the last 20 steps)


class StepCosts:
    """Seconds one step of each (tokens, seqs) bucket takes."""

    def __init__(
        self,
        token_buckets: Sequence[int],
        seq_buckets: Sequence[int],
        seed: Mapping[tuple[int, int], float] | None = None,
    ) -> None:
        self.token_buckets = tuple(token_buckets)
        self.seq_buckets = tuple(seq_buckets)
        # Moving average of every served step's time, whatever its bucket: what a step costs
        # under the current mix of decodes and prefill chunks (None before the first step).
        self.recent: float | None = None
        self.seconds: dict[tuple[int, int], float] = {}
        for (tokens, seqs), secs in (seed or {}).items():
            if secs > 0:
                self.seconds[(tokens, seqs)] = float(secs)

    def bucket(self, num_tokens: int, num_seqs: int) -> tuple[int, int]:
        return pick_step_bucket(
            self.token_buckets, self.seq_buckets, max(1, num_tokens), max(1, num_seqs)
        )

    def observe(self, num_tokens: int, num_seqs: int, seconds: float) -> None:
        """Learn from one served step (`seconds` of wall time, device and sampling)."""
        key = self.bucket(num_tokens, num_seqs)
        old = self.seconds.get(key)
        self.seconds[key] = seconds if old is None else old + EWMA_WEIGHT * (seconds - old)
        recent = self.recent
        self.recent = seconds if recent is None else recent + RECENT_WEIGHT * (seconds - recent)

    def cost(self, num_tokens: int, num_seqs: int) -> float | None:
        """Estimated seconds of a step of this many tokens and sequences; None if nothing
        has been measured yet."""
        key = self.bucket(num_tokens, num_seqs)
        known = self.seconds.get(key)
        if known is not None:
            return known
        if not self.seconds:
            return None
        tokens, seqs = key
        # The measured bucket nearest in tokens (then in seqs), scaled linearly by tokens:
        # steps are compute-bound per token on CPU, which makes this an overestimate below.
        near = min(self.seconds, key=lambda k: (abs(k[0] - tokens), abs(k[1] - seqs)))
        return self.seconds[near] * max(1.0, tokens / near[0])

    def largest_within(self, seconds: float, num_seqs: int) -> int | None:
        """The largest token bucket whose step with `num_seqs` sequences is estimated to take
        at most `seconds`; None if not even the smallest such bucket does (or none measured)."""
        best = None
        for tokens in self.token_buckets:
            if tokens < num_seqs:
                continue
            cost = self.cost(tokens, num_seqs)
            if cost is not None and cost <= seconds:
                best = tokens
        return best


def load_bucket_report(path: str) -> dict[tuple[int, int], float]:
    """(tokens, seqs) -> seconds from a `bench/buckets.py` JSON report (its "mixed" steps:
    decodes plus prefill chunks, what serving under load runs)."""
    try:
        report = json.loads(Path(path).read_text())
        rows = report["buckets"]
        return {
            (int(row["T"]), int(row["S"])): float(row["mixed"]["step_ms"]) / 1000.0 for row in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a bench/buckets.py report with per-bucket 'mixed' step times: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def check_target_itl(target_itl_ms: float, costs: StepCosts) -> None:
    """ValueError unless some step can meet `target_itl_ms` (0 = no target)."""
    if not target_itl_ms:
        return
    smallest = costs.cost(1, 1)
    if smallest is None:
        raise ValueError("target_itl_ms needs measured step costs, and none are known")
    if target_itl_ms / 1000.0 < smallest:
        raise ValueError(
            f"target_itl_ms={target_itl_ms:g} is below the measured step time of the smallest "
            f"bucket ({smallest * 1000.0:.1f} ms for one token): no step can meet it; raise "
            f"it, or 0 for a fixed budget"
        )
