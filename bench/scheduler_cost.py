"""Host cost of one scheduler iteration: schedule() + update_from_output().

Steady-state serving without a model, as `jserve.simulate.host_cost` describes it (the same
load `jserve compile` measures beside the estimated decode step of its target).

    python -m bench.scheduler_cost            # full run (about a minute)
    python -m bench.scheduler_cost --smoke    # a few seconds, for CI
"""

from __future__ import annotations

import argparse

from jserve.simulate.host_cost import measure_iterations, percentile


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="few iterations, for CI")
    parser.add_argument("--iterations", type=int, default=None)
    args = parser.parse_args()
    iterations = args.iterations or (100 if args.smoke else 3000)
    for num_running, num_waiting in ((256, 1024), (1024, 1024)):
        label = f"{num_running} running decodes, {num_waiting} waiting"
        print(f"{label}: {iterations} iterations")
        costs = measure_iterations(num_running, num_waiting, iterations, seed=num_running)
        stats = costs.stats
        print(
            f"  state after: running={stats.num_running} waiting={stats.num_waiting} "
            f"kv_usage={stats.kv_cache_usage:.2f} preemptions={stats.num_preemptions} "
            f"prefix hits/queries={stats.prefix_cache_hits}/{stats.prefix_cache_queries}"
        )
        wall, cpu = costs.wall_ms, costs.cpu_ms
        print(
            f"  {label}: p50 {percentile(wall, 50):.3f} ms  p90 {percentile(wall, 90):.3f} ms"
            f"  p99 {percentile(wall, 99):.3f} ms wall; CPU p50 {percentile(cpu, 50):.3f} ms"
            f"  p99 {percentile(cpu, 99):.3f} ms  (schedule + update_from_output)"
        )


if __name__ == "__main__":
    main()
