"""Small drivers shared by the scheduling-core tests."""

from __future__ import annotations

from collections.abc import Callable

from jserve.config.scheduler import CacheConfig, SchedulerConfig
from jserve.core.block_manager import BlockManager
from jserve.core.plan import StepPlan
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.step_costs import StepCosts
from jserve.core.stopping import StopConditions
from jserve.core.tenants import TenantPolicy

EOS = 2
FILLER = 7  # a sampled token that never stops anything


def free_block_ids(manager: BlockManager) -> set[int]:
    """Blocks an allocation may take: the plain free ones and the prefix cache's evictable
    ones (read from the manager's internals, for invariant checks)."""
    cache = manager.prefix_cache
    return set(manager._free) | (set(cache._evictable) if cache is not None else set())


def tracked(scheduler: Scheduler, request_id: str) -> Request | None:
    """The unfinished request `scheduler` tracks under `request_id`, if any (its internals)."""
    return scheduler._requests.get(request_id)


def make_scheduler(
    block_size: int = 4,
    num_blocks: int = 64,
    tenants: TenantPolicy | None = None,
    step_costs: StepCosts | None = None,
    **config,
) -> Scheduler:
    config.setdefault("max_num_seqs", 8)
    config.setdefault("max_num_batched_tokens", 32)
    config.setdefault("max_model_len", 128)
    config.setdefault("free_block_watermark", 0.0)
    cache = CacheConfig(block_size, num_blocks)
    return Scheduler(SchedulerConfig(**config), cache, tenants, step_costs)


def make_request(
    request_id: str,
    prompt_len: int,
    first_token: int = 1000,
    *,
    max_tokens: int = 4,
    min_tokens: int = 0,
    **kwargs,
) -> Request:
    """A request stopping on EOS (after min_tokens) or at max_tokens."""
    kwargs.setdefault("arrival_time", 0.0)
    stop = StopConditions(max_tokens, min_tokens, frozenset({EOS}))
    prompt = list(range(first_token, first_token + prompt_len))
    return Request(request_id, prompt, stop=stop, **kwargs)


def chunks(plan: StepPlan) -> list[tuple[str, int, int, bool]]:
    """(request id, start, number of tokens, sample) of each scheduled seq."""
    return [(s.request_id, s.start_pos, s.num_tokens, s.sample) for s in plan.seqs]


def step(
    scheduler: Scheduler,
    token: Callable[[str], int] = lambda request_id: FILLER,
    now: float | None = 0.0,
) -> tuple[StepPlan, list[Request]]:
    """One iteration in which every sampling seq gets `token(request_id)`."""
    plan = scheduler.schedule(now)
    sampled = {s.request_id: token(s.request_id) for s in plan.seqs if s.sample}
    return plan, scheduler.update_from_output(plan, sampled)


def run_until_idle(scheduler: Scheduler, max_steps: int = 1000) -> list[StepPlan]:
    plans = []
    while scheduler.has_unfinished_requests():
        assert len(plans) < max_steps, "the scheduler did not drain"
        plans.append(step(scheduler)[0])
    return plans
