"""Cost models: what one planned step takes, in seconds of the simulator's virtual clock.

- MeasuredCost: a per-bucket table (a `python -m bench.bucket_costs` report, or the table a
  server learned while serving, `jserve serve --save-step-costs`); a step costs its padded
  bucket plus the engine's host work per step.
- RooflineCost: a GPU or TPU from its published figures: max(bytes moved / memory bandwidth,
  FLOPs / matmul rate) plus a fixed launch overhead, where the bytes are the weights once plus
  the KV cache every sequence reads, and the FLOPs 2 x parameters per token (defaults: an H200,
  4.3 TB/s and 790 TFLOP/s bf16, serving an 8B-parameter Llama-3-like model). Decode is then
  memory-bound: batching is nearly free.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jserve.core.buckets import step_buckets
from jserve.core.plan import StepPlan
from jserve.core.step_costs import StepCosts, load_bucket_report

CostModel = Callable[[StepPlan], float]


class MeasuredCost:
    """Seconds per step from a measured table (the step's padded bucket), plus the engine's
    host work per step (scheduling, input building, sampling, output processing) that the
    table's model-step times leave out."""

    label = "measured table"

    def __init__(self, costs: StepCosts, host_s: float = 0.0) -> None:
        if not costs.seconds:
            raise ValueError("a measured cost model needs a table with at least one bucket")
        self.costs = costs
        self.host_s = host_s

    @classmethod
    def from_report(
        cls, path: str, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]
    ) -> MeasuredCost:
        """The cost model of a bucket report (or a table a server learned) for these buckets."""
        if not Path(path).is_file():
            raise ValueError(
                f"no step-cost table at {path}: give a `python -m bench.bucket_costs` report or "
                "a table `jserve serve --save-step-costs` wrote, or use the roofline cost model"
            )
        table = StepCosts(token_buckets, seq_buckets, load_bucket_report(path))
        return cls(table, host_seconds_per_step(path))

    def fresh_table(self) -> StepCosts:
        """A copy of the table for a scheduler to price with (and learn into)."""
        return StepCosts(self.costs.token_buckets, self.costs.seq_buckets, self.costs.seconds)

    def __call__(self, plan: StepPlan) -> float:
        cost = self.costs.cost(plan.num_batched_tokens, len(plan.seqs))
        assert cost is not None, "a non-empty table prices every bucket"
        return cost + self.host_s


def host_seconds_per_step(report_path: str) -> float:
    """The engine's time per step beyond the table's step times: the time between steps of a
    table the engine learned while serving (`jserve serve --save-step-costs`), or a bucket
    report's workload run (its engine-step wall time less its runner time, over its steps);
    0 for a report with neither."""
    report = json.loads(Path(report_path).read_text())
    if "between_steps_ms" in report:
        return report["between_steps_ms"] / 1000.0
    workload = report.get("workload") or {}
    steps = workload.get("steps") or 0
    if not steps:
        return 0.0
    return max(0.0, (workload["wall_s"] - workload["runner_s"]) / steps)


@dataclass(frozen=True)
class RooflineCost:
    """max(bytes / bandwidth, flops / peak) + overhead, per step."""

    bandwidth: float = 4.3e12  # bytes/s: H200 measured copy bandwidth
    peak_flops: float = 790e12  # bf16 dense matmul
    params: float = 8.0e9  # Llama-3-8B-like
    bytes_per_param: float = 2.0
    kv_bytes_per_token: float = 32 * 8 * 128 * 2 * 2  # layers * kv heads * dim * (k, v) * bf16
    overhead_s: float = 0.0015  # launches and host work per step
    label: str = "roofline (H200, 8B bf16)"

    def __call__(self, plan: StepPlan) -> float:
        kv_tokens = sum(seq.start_pos + len(seq.token_ids) for seq in plan.seqs)
        moved = self.params * self.bytes_per_param + kv_tokens * self.kv_bytes_per_token
        flops = 2.0 * self.params * plan.num_batched_tokens
        return max(moved / self.bandwidth, flops / self.peak_flops) + self.overhead_s

    def table(self, token_buckets: tuple[int, ...], seq_buckets: tuple[int, ...]) -> StepCosts:
        """The same model as a bucket table, for admission and target_itl_ms (each sequence
        of a bucket priced with a 512-token context)."""
        seed = {}
        for tokens, seqs in step_buckets(token_buckets, seq_buckets):
            moved = self.params * self.bytes_per_param + 512 * seqs * self.kv_bytes_per_token
            flops = 2.0 * self.params * tokens
            compute = max(moved / self.bandwidth, flops / self.peak_flops)
            seed[(tokens, seqs)] = compute + self.overhead_s
        return StepCosts(token_buckets, seq_buckets, seed)
