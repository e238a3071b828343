"""The real jserve.core scheduler driven in virtual time: no model runs.

Each step the scheduler plans is priced by a cost model (jserve.simulate.costs) and the clock
advances by that much; sampled tokens are a filler (no EOS: every request generates its
`max_tokens`, as the serving benchmark's ignore_eos does). Requests join the scheduler when the
clock passes their arrival, and every streamed token is recorded as a RequestRecord, so the
figures are the serving benchmark's (jserve.simulate.metrics).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field

from jserve.config.scheduler import LANES, CacheConfig, SchedulerConfig
from jserve.core.plan import StepPlan
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.step_costs import StepCosts
from jserve.core.stopping import StopConditions
from jserve.core.tenants import TenantPolicy
from jserve.errors import RequestRejected
from jserve.simulate.costs import CostModel
from jserve.simulate.metrics import RequestRecord
from jserve.simulate.workload import SimRequest

FILLER_TOKEN = 7


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration: float
    steps: int
    served: dict[str, int] = field(default_factory=dict)  # tenant -> tokens computed for it
    # The same, counted only in steps in which every tenant of the workload had a request
    # waiting: the share of service while all are backlogged, what fair share is about.
    served_backlogged: dict[str, int] = field(default_factory=dict)
    deadline_misses: int = 0  # admitted requests that timed out
    within_deadline: int = 0  # completed before their deadline


class _Simulation:
    """One run's state: the clock, the arrivals still to come, and what each request saw."""

    def __init__(
        self, workload: list[SimRequest], scheduler: Scheduler, cost_model: CostModel
    ) -> None:
        self.workload, self.scheduler, self.cost_model = workload, scheduler, cost_model
        self.order = sorted(range(len(workload)), key=lambda i: workload[i].arrival_s)
        self.records = [
            RequestRecord(index=i, group=w.tenant, expected_output_tokens=w.max_tokens)
            for i, w in enumerate(workload)
        ]
        self.result = SimResult(self.records, 0.0, 0)
        self.by_id: dict[str, int] = {}  # scheduler request id -> workload index
        self.tenants = {w.tenant for w in workload}
        self.now, self.next_arrival = 0.0, 0

    def pending(self) -> bool:
        return self.next_arrival < len(self.order) or self.scheduler.has_unfinished_requests()

    def skip_to_next_arrival(self) -> None:
        if self.next_arrival < len(self.order):
            arrival = self.workload[self.order[self.next_arrival]].arrival_s
            self.now = max(self.now, arrival)

    def admit_arrivals(self) -> None:
        """Hand the scheduler every request that has arrived by now (or its refusal)."""
        while (
            self.next_arrival < len(self.order)
            and self.workload[self.order[self.next_arrival]].arrival_s <= self.now
        ):
            index = self.order[self.next_arrival]
            self.next_arrival += 1
            spec, record = self.workload[index], self.records[index]
            record.start, record.prompt_tokens = spec.arrival_s, spec.prompt_tokens
            prompt = array(
                "q", (100 + (index * 7919 + k) % 30000 for k in range(spec.prompt_tokens))
            )
            request = Request(
                f"r{index}", prompt, stop=StopConditions(spec.max_tokens, 0, frozenset()),
                arrival_time=spec.arrival_s, lane=spec.lane, tenant=spec.tenant,
                deadline=None if spec.timeout is None else spec.arrival_s + spec.timeout,
            )  # fmt: skip
            try:
                self.scheduler.add_request(request, now=self.now)
            except RequestRejected as exc:
                record.error = f"rejected {exc.reason}"
                continue
            self.by_id[request.request_id] = index

    def count_served(self, plan: StepPlan) -> None:
        backlogged: set[str] = set()
        for lane in LANES:
            backlogged |= set(self.scheduler.waiting.tenant_queues(lane))
        all_waiting = len(self.tenants) > 1 and backlogged >= self.tenants
        served, during_backlog = self.result.served, self.result.served_backlogged
        for seq in plan.seqs:
            tenant = self.workload[self.by_id[seq.request_id]].tenant
            served[tenant] = served.get(tenant, 0) + len(seq.token_ids)
            if all_waiting:
                during_backlog[tenant] = during_backlog.get(tenant, 0) + len(seq.token_ids)

    def finish_step(self, plan: StepPlan) -> None:
        """Stream each sampled token at the step's end and finish what is done."""
        sampled = {seq.request_id: FILLER_TOKEN for seq in plan.seqs if seq.sample}
        for request_id in sampled:
            record = self.records[self.by_id[request_id]]
            if not record.chunk_times:
                record.ttft = self.now - record.start
            record.chunk_times.append(self.now)
            record.chunk_tokens.append(1)
            record.output_tokens += 1
        for request in self.scheduler.update_from_output(plan, sampled):
            index = self.by_id.pop(request.request_id)
            record = self.records[index]
            record.success = True
            record.e2e = self.now - record.start
            timeout = self.workload[index].timeout
            self.result.within_deadline += timeout is None or record.e2e <= timeout


def simulate(
    workload: list[SimRequest],
    config: SchedulerConfig,
    num_blocks: int,
    cost_model: CostModel,
    step_costs: StepCosts | None,
    tenants: TenantPolicy | None = None,
    block_size: int = 16,
    max_steps: int = 2_000_000,
) -> SimResult:
    """Run `workload` through a real Scheduler; `step_costs` (or None) is what the scheduler
    prices admission and target_itl_ms with, `cost_model` what a step actually takes."""
    scheduler = Scheduler(config, CacheConfig(block_size, num_blocks), tenants, step_costs)
    run = _Simulation(workload, scheduler, cost_model)
    result = run.result
    while run.pending():
        run.admit_arrivals()
        if not scheduler.has_unfinished_requests():
            run.skip_to_next_arrival()
            continue
        plan = scheduler.schedule(run.now)
        for request_id in plan.finished:  # deadline expiry
            run.records[run.by_id.pop(request_id)].error = "timeout"
            result.deadline_misses += 1
        if plan.is_empty:
            run.skip_to_next_arrival()
            continue
        result.steps += 1
        if result.steps > max_steps:
            raise RuntimeError(f"the simulation did not finish in {max_steps} steps")
        seconds = cost_model(plan)
        run.now += seconds
        if step_costs is not None:
            step_costs.observe(plan.num_batched_tokens, len(plan.seqs), seconds)
        run.count_served(plan)
        run.finish_step(plan)
    start = min((w.arrival_s for w in workload), default=0.0)
    result.duration = max(run.now - start, 1e-9)
    return result
