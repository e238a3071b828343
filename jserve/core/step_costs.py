"""Measured step costs per precompiled bucket, learned online: what admission and the
adaptive token budget price steps with.

Every step runs padded to a (tokens, seqs) bucket (jserve.core.buckets), so its time depends
on the bucket, not on the exact batch. The table starts from a seed (a `bench.bucket_costs`
report, or the engine's own warm timing at start-up) and each served step updates its
bucket's entry by an exponential moving average, so the estimates follow the machine's actual
load. A bucket never measured is priced from the nearest measured one, scaled by tokens.

A decode's inter-token latency is more than its step: the engine also schedules, builds the
next step's inputs and hands outputs to the server between two steps, and a step's time
varies from one run to the next. The adaptive budget (`largest_within`) therefore prices a
step as its mean plus TAIL_DEVIATIONS of its measured deviation plus the measured time
between steps, so a target holds for the tail of the latencies, not only their mean.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

from jserve.config.settings import InvalidSetting
from jserve.core.buckets import pick_step_bucket

EWMA_WEIGHT = 0.2  # weight of the newest measurement of a bucket
RECENT_WEIGHT = 0.05  # of the newest step in the load-mix average (about the last 20 steps)
# Mean absolute deviations above the mean that a step priced for a latency target may take:
# about a 98th percentile for normally distributed step times (the mean absolute deviation
# is 0.8 standard deviations).
TAIL_DEVIATIONS = 2.5


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
        # Moving average of each bucket's absolute deviation from its mean.
        self.deviation: dict[tuple[int, int], float] = {}
        # Moving average of the engine's time between the end of one model step and the
        # start of the next while requests keep running (0 until measured).
        self.between_steps = 0.0
        self.num_observed = 0  # served steps observed
        # Each bucket's latest time and the `num_observed` it came at (served steps only).
        self.latest: dict[tuple[int, int], tuple[float, int]] = {}
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
        if old is None:
            self.seconds[key] = seconds
        else:
            self.seconds[key] = old + EWMA_WEIGHT * (seconds - old)
            dev = self.deviation.get(key, 0.0)
            self.deviation[key] = dev + EWMA_WEIGHT * (abs(seconds - old) - dev)
        recent = self.recent
        self.recent = seconds if recent is None else recent + RECENT_WEIGHT * (seconds - recent)
        self.num_observed += 1
        self.latest[key] = (seconds, self.num_observed)

    def observe_between_steps(self, seconds: float) -> None:
        """Learn the engine's time from the end of one step to the start of the next."""
        self.between_steps += RECENT_WEIGHT * (max(0.0, seconds) - self.between_steps)

    def optimistic(self, num_tokens: int, num_seqs: int, within: int) -> float | None:
        """Seconds of this step's bucket for a choice that only learns what it tries (how many
        speculative drafts a step takes: jserve.core.drafting): the lower of its moving
        average and its latest time, if it was served within the last `within` observed
        steps; None if not (never served, or not lately), so the choice tries it again. A
        pessimistic estimate (a first run's one-off costs, a moment of load) would otherwise
        keep a bucket out of use, and so never be corrected."""
        key = self.bucket(num_tokens, num_seqs)
        latest = self.latest.get(key)
        if latest is None or self.num_observed - latest[1] > within:
            return None
        return min(self.seconds[key], latest[0])

    def cost(self, num_tokens: int, num_seqs: int) -> float | None:
        """Estimated seconds of a step of this many tokens and sequences; None if nothing
        has been measured yet."""
        key = self.bucket(num_tokens, num_seqs)
        known = self.seconds.get(key)
        if known is not None:
            return known
        if not self.seconds:
            return None
        # The measured bucket nearest in tokens (then in seqs), scaled linearly by tokens:
        # steps are compute-bound per token on CPU, which makes this an overestimate below.
        near = self._nearest(key)
        return self.seconds[near] * max(1.0, key[0] / near[0])

    def _nearest(self, key: tuple[int, int]) -> tuple[int, int]:
        tokens, seqs = key
        return min(self.seconds, key=lambda k: (abs(k[0] - tokens), abs(k[1] - seqs)))

    def latency(self, num_tokens: int, num_seqs: int) -> float | None:
        """Seconds a running decode waits for its next token when the next step has this many
        tokens and sequences, at the tail: the step's mean plus TAIL_DEVIATIONS of its
        deviation (a bucket not measured twice borrows the nearest one's, scaled like its
        mean) plus the time between steps; None if nothing has been measured yet."""
        mean = self.cost(num_tokens, num_seqs)
        if mean is None:
            return None
        key = self.bucket(num_tokens, num_seqs)
        if key in self.deviation:
            dev = self.deviation[key]
        else:
            near = self._nearest(key)
            dev = self.deviation.get(near, 0.0) * mean / self.seconds[near]
        return mean + TAIL_DEVIATIONS * dev + self.between_steps

    def largest_within(self, seconds: float, num_seqs: int) -> int | None:
        """The largest token bucket whose step with `num_seqs` sequences keeps a running
        decode's inter-token latency (`latency`) within `seconds`; None if not even the
        smallest such bucket does (or none measured)."""
        best = None
        for tokens in self.token_buckets:
            if tokens < num_seqs:
                continue
            latency = self.latency(tokens, num_seqs)
            if latency is not None and latency <= seconds:
                best = tokens
        return best


def learned_report(costs: StepCosts) -> dict:
    """The table as the engine learned it while serving, in the shape of a bench.bucket_costs
    report (each bucket's time under "mixed"), so `--step-costs-file` and `jserve simulate`'s
    `--bucket-report` read it; "between_steps_ms" is the host time between two steps."""
    return {
        "source": "learned while serving",
        "between_steps_ms": costs.between_steps * 1000.0,
        "buckets": [
            {"T": tokens, "S": seqs, "mixed": {"step_ms": secs * 1000.0}}
            for (tokens, seqs), secs in sorted(costs.seconds.items())
        ],
    }


def load_bucket_report(path: str) -> dict[tuple[int, int], float]:
    """(tokens, seqs) -> seconds from a `bench.bucket_costs` JSON report (its "mixed" steps:
    decodes plus prefill chunks, what serving under load runs)."""
    try:
        report = json.loads(Path(path).read_text())
        rows = report["buckets"]
        return {
            (int(row["T"]), int(row["S"])): float(row["mixed"]["step_ms"]) / 1000.0 for row in rows
        }
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"{path} is not a bench.bucket_costs report with per-bucket 'mixed' step times: "
            f"{type(exc).__name__}: {exc}"
        ) from None


def check_target_itl(target_itl_ms: float, costs: StepCosts) -> None:
    """InvalidSetting unless some step can meet `target_itl_ms` (0 = no target)."""
    if not target_itl_ms:
        return
    smallest = costs.cost(1, 1)
    if smallest is None:
        raise InvalidSetting(
            "target_itl_ms", "target_itl_ms needs measured step costs, and none are known"
        )
    if target_itl_ms / 1000.0 < smallest:
        raise InvalidSetting(
            "target_itl_ms",
            f"target_itl_ms={target_itl_ms:g} is below the measured step time of the smallest "
            f"bucket ({smallest * 1000.0:.1f} ms for one token): no step can meet it; raise "
            f"it, or 0 for a fixed budget",
        )
