"""Cost models: what one planned step takes, in seconds of the simulator's virtual clock.

Every model is a per-bucket table (`MeasuredCost`): a step costs its padded bucket, plus the
engine's host work per step where the table knows it. The table is
- measured: a `python -m bench.bucket_costs` report, or the table a server learned while
  serving (`jserve serve --save-step-costs`);
- or estimated: a `jserve compile` report (`CompiledEngine`), each step bucket's roofline
  (max(FLOPs / peak, bytes / HBM bandwidth) of XLA's cost analysis of the compiled step and
  the attention kernel's own count at max_model_len context, on the chip's public peaks; see
  docs/tpu.md). A floor, with no host time: an estimate for a chip this machine lacks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from jserve.config.scheduler import SchedulerConfig
from jserve.core.plan import StepPlan
from jserve.core.step_costs import StepCosts, load_bucket_report

CostModel = Callable[[StepPlan], float]


class MeasuredCost:
    """Seconds per step from a measured table (the step's padded bucket), plus the engine's
    host work per step (scheduling, input building, sampling, output processing) that the
    table's model-step times leave out."""

    def __init__(self, costs: StepCosts, host_s: float = 0.0, label: str = "measured table"):
        if not costs.seconds:
            raise ValueError("a measured cost model needs a table with at least one bucket")
        self.costs = costs
        self.host_s = host_s
        self.label = label

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
class CompiledEngine:
    """The engine a `jserve compile` report describes: its step buckets, each one's roofline
    time, and its KV pool."""

    label: str
    token_buckets: tuple[int, ...]
    seq_buckets: tuple[int, ...]
    step_seconds: dict[tuple[int, int], float]
    num_blocks: int
    block_size: int
    max_model_len: int

    @classmethod
    def from_report(cls, path: str) -> CompiledEngine:
        """Read a `jserve compile --report` JSON; ValueError naming what is missing."""
        try:
            report = json.loads(Path(path).read_text())
            steps = {
                (int(r["tokens"]), int(r["seqs"])): float(r["roofline_ms"]) / 1000.0
                for r in report["executables"]
                if r["name"].endswith(" step") and r["roofline_ms"] is not None
            }
            engine = cls(
                label=f"roofline estimate ({report['model']} on {report['target']})",
                token_buckets=tuple(report["token_buckets"]),
                seq_buckets=tuple(report["seq_buckets"]),
                step_seconds=steps,
                num_blocks=int(report["num_blocks"]),
                block_size=int(report["block_size"]),
                max_model_len=int(report["max_model_len"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ValueError(
                f"{path} is not a `jserve compile --report` JSON with token_buckets, "
                f"seq_buckets and executables: {type(exc).__name__}: {exc}"
            ) from None
        if not steps:
            raise ValueError(
                f"{path} has no model step with a roofline time: compile for a TPU or GPU "
                "target (a CPU target has no chip figures)"
            )
        return engine

    def cost_model(self) -> MeasuredCost:
        """Each step at its bucket's roofline (a bucket not compiled: the nearest one's,
        scaled by tokens), no host time."""
        return MeasuredCost(self.fresh_table(), 0.0, self.label)

    def fresh_table(self) -> StepCosts:
        return StepCosts(self.token_buckets, self.seq_buckets, self.step_seconds)

    def scheduler_config(self, **settings: object) -> SchedulerConfig:
        """The compiled engine's limits (its largest buckets and max_model_len), with
        `settings` (fairness, scheduling, ...) on top."""
        return SchedulerConfig(
            max_num_seqs=self.seq_buckets[-1],
            max_num_batched_tokens=self.token_buckets[-1],
            max_model_len=self.max_model_len,
            **settings,  # type: ignore[arg-type]
        )
