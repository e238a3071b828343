"""Host cost of one scheduler iteration: `schedule()` + `update_from_output()` of the real
jserve.core scheduler, pure Python, no model.

Steady-state serving: requests with random prompt lengths (sharing a system prompt, so prefix
caching works), random output lengths, and arrivals that keep the waiting queue at its target
size, so every iteration mixes decodes, finishes and prefill chunks. The sampled-token dict
(the engine's job) is built outside the timed region. Lengths scale with `max_model_len` (at
2,048: prompts of 64 shared and 16-448 own tokens, 200-1,000 output tokens), and the KV pool holds
about 0.8 x max_model_len tokens per running request. `python -m bench.scheduler_cost` prints
these figures; `jserve compile` puts them beside the estimated decode step of its target.
"""

from __future__ import annotations

import math
import random
import statistics
import time
from dataclasses import dataclass

from jserve.config.scheduler import CacheConfig, SchedulerConfig
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler, SchedulerStats
from jserve.core.stopping import StopConditions

EOS = 2
SYSTEM_PROMPT = list(range(100, 164))  # 64 shared tokens
REFERENCE_LEN = 2048  # the max_model_len the lengths above are given for
WARM_UP_LIMIT = 10_000  # iterations to fill the running set (a few hundred at 1,024)
FULL = 0.95  # the running set is full at this share of its target


@dataclass
class IterationCosts:
    """Per-iteration host cost at one load: wall and thread-CPU milliseconds, and the
    scheduler's state after the run."""

    wall_ms: list[float]
    cpu_ms: list[float]
    stats: SchedulerStats


def percentile(values: list[float], q: int) -> float:
    """The q-th percentile (1-99) of `values`, interpolated between the closest ranks."""
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def _request(rng: random.Random, index: int, scale: float) -> Request:
    def scaled(n: int) -> int:
        return max(1, int(n * scale))

    extra = rng.randint(scaled(16), scaled(448))
    prompt = SYSTEM_PROMPT[: scaled(64)] + [rng.randrange(1000, 49000) for _ in range(extra)]
    outputs = rng.randint(scaled(200), scaled(1000))
    return Request(
        f"req-{index}",
        prompt,
        stop=StopConditions(max_tokens=outputs, stop_token_ids=frozenset({EOS})),
        arrival_time=float(index),
    )


class _Load:
    """A scheduler under the synthetic load, one timed iteration at a time."""

    def __init__(self, running: int, waiting: int, block_size: int, max_model_len: int, seed: int):
        self.rng = random.Random(seed)
        self.scale = max_model_len / REFERENCE_LEN
        blocks_per_request = math.ceil(max_model_len * 25 / 32 / block_size)  # 100 at 2048 / 16
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=running,
                max_num_batched_tokens=2 * running,
                max_model_len=max_model_len,
                long_prompt_threshold=max_model_len,
                max_waiting_requests=waiting + running,
            ),
            CacheConfig(block_size=block_size, num_blocks=running * blocks_per_request),
        )
        self.added = 0

    def top_up(self, waiting: int) -> None:
        while len(self.scheduler.waiting) < waiting:
            self.scheduler.add_request(_request(self.rng, self.added, self.scale))
            self.added += 1

    def iteration(self) -> tuple[float, float]:
        """(wall, thread CPU) milliseconds; CPU time is immune to other processes' load."""
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        plan = self.scheduler.schedule()
        wall_mid, cpu_mid = time.perf_counter_ns(), time.thread_time_ns()
        # A rare EOS keeps requests finishing (and waiting ones joining) at a steady rate.
        sampled = {
            seq.request_id: EOS if self.rng.random() < 0.002 else self.rng.randrange(1000, 49000)
            for seq in plan.seqs
            if seq.sample
        }
        wall_resumed, cpu_resumed = time.perf_counter_ns(), time.thread_time_ns()
        self.scheduler.update_from_output(plan, sampled)
        wall_end, cpu_end = time.perf_counter_ns(), time.thread_time_ns()
        return (
            (wall_mid - wall + wall_end - wall_resumed) / 1e6,
            (cpu_mid - cpu + cpu_end - cpu_resumed) / 1e6,
        )


def measure_iterations(
    running: int,
    waiting: int,
    iterations: int,
    seed: int,
    block_size: int = 16,
    max_model_len: int = REFERENCE_LEN,
) -> IterationCosts:
    """Host cost of `iterations` scheduler iterations at `running` decodes with `waiting`
    requests queued, after the running set has filled and its first prompts are prefilled."""
    load = _Load(running, waiting, block_size, max_model_len, seed)
    load.top_up(running + waiting)
    # Warm-up: fill the running set, arrivals going on (at a short context requests finish
    # fast, so a few slots are always between a finish and an admission).
    for _ in range(WARM_UP_LIMIT):
        if len(load.scheduler.running) >= FULL * running:
            break
        load.top_up(waiting)
        load.iteration()
    else:
        raise RuntimeError(f"the load did not reach {running} running in {WARM_UP_LIMIT} steps")
    for _ in range(50):
        load.top_up(waiting)
        load.iteration()  # ... and let the first prompts' prefill finish
    costs = []
    for _ in range(iterations):
        load.top_up(waiting)
        costs.append(load.iteration())
    return IterationCosts(
        [wall for wall, _ in costs], [cpu for _, cpu in costs], load.scheduler.stats()
    )
