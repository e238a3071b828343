"""Host cost of one scheduler iteration: schedule() + update_from_output().

Steady-state serving without a model: requests with random prompt lengths (sharing a system
prompt, so prefix caching works), random output lengths, and arrivals that keep the waiting
queue at its target size, so every iteration mixes decodes, finishes and prefill chunks.
The sampled-token dict (the engine's job) is built outside the timed region.

    python -m bench.scheduler_cost            # full run (about a minute)
    python -m bench.scheduler_cost --smoke    # a few seconds, for CI
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from jserve.config.scheduler import CacheConfig, SchedulerConfig
from jserve.core.request import Request
from jserve.core.scheduler import Scheduler
from jserve.core.stopping import StopConditions

EOS = 2
SYSTEM_PROMPT = list(range(100, 164))  # 64 shared tokens


def make_request(rng: random.Random, index: int) -> Request:
    prompt = SYSTEM_PROMPT + [rng.randrange(1000, 49000) for _ in range(rng.randint(16, 448))]
    return Request(
        f"req-{index}",
        prompt,
        stop=StopConditions(max_tokens=rng.randint(200, 1000), stop_token_ids=frozenset({EOS})),
        arrival_time=float(index),
    )


def run_scenario(
    num_running: int, num_waiting: int, iterations: int, seed: int
) -> list[tuple[float, float]]:
    """Per-iteration host cost (wall, CPU) in milliseconds at `num_running` decodes."""
    rng = random.Random(seed)
    scheduler = Scheduler(
        SchedulerConfig(
            max_num_seqs=num_running,
            max_num_batched_tokens=2 * num_running,
            max_model_len=2048,
            long_prompt_threshold=2048,
            max_waiting_requests=num_waiting + num_running,
        ),
        CacheConfig(block_size=16, num_blocks=num_running * 100),
    )
    num_added = 0

    def top_up_waiting(target: int) -> None:
        nonlocal num_added
        while len(scheduler.waiting) < target:
            scheduler.add_request(make_request(rng, num_added))
            num_added += 1

    def one_iteration() -> tuple[float, float]:
        """(wall, thread CPU) milliseconds; CPU time is immune to other processes' load."""
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        plan = scheduler.schedule()
        wall_mid, cpu_mid = time.perf_counter_ns(), time.thread_time_ns()
        # A rare EOS keeps requests finishing (and waiting ones joining) at a steady rate.
        sampled = {
            seq.request_id: EOS if rng.random() < 0.002 else rng.randrange(1000, 49000)
            for seq in plan.seqs
            if seq.sample
        }
        wall_resumed, cpu_resumed = time.perf_counter_ns(), time.thread_time_ns()
        scheduler.update_from_output(plan, sampled)
        wall_end, cpu_end = time.perf_counter_ns(), time.thread_time_ns()
        return (
            (wall_mid - wall + wall_end - wall_resumed) / 1e6,
            (cpu_mid - cpu + cpu_end - cpu_resumed) / 1e6,
        )

    top_up_waiting(num_running + num_waiting)
    while len(scheduler.running) < num_running:
        one_iteration()  # warm-up: fill the running set
    for _ in range(50):
        one_iteration()  # ... and let the first prompts' prefill finish
    costs = []
    for _ in range(iterations):
        top_up_waiting(num_waiting)
        costs.append(one_iteration())
    stats = scheduler.stats()
    print(
        f"  state after: running={stats.num_running} waiting={stats.num_waiting} "
        f"kv_usage={stats.kv_cache_usage:.2f} preemptions={stats.num_preemptions} "
        f"prefix hits/queries={stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
    )
    return costs


def percentile(values: list[float], q: float) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few iterations, for CI")
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args()
    iterations = args.iterations or (100 if args.smoke else 3000)
    for num_running, num_waiting in ((256, 1024), (1024, 1024)):
        label = f"{num_running} running decodes, {num_waiting} waiting"
        print(f"{label}: {iterations} iterations")
        costs = run_scenario(num_running, num_waiting, iterations, seed=num_running)
        wall = [c[0] for c in costs]
        cpu = [c[1] for c in costs]
        print(
            f"  {label}: p50 {percentile(wall, 50):.3f} ms  p90 {percentile(wall, 90):.3f} ms"
            f"  p99 {percentile(wall, 99):.3f} ms wall; CPU p50 {percentile(cpu, 50):.3f} ms"
            f"  p99 {percentile(cpu, 99):.3f} ms  (schedule + update_from_output)"
        )


if __name__ == "__main__":
    main()
