"""The host beside the chip: what one scheduler iteration costs on this machine's CPU, at the
loads a big slice serves (jserve.simulate.host_cost, the load `python -m bench.scheduler_cost`
measures), for the report to set beside the estimated decode step. The engine schedules
between two steps, so a chip waits for the host unless an iteration is short next to a step.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

from jserve.aot.report import HostCost, HostLoad
from jserve.simulate.host_cost import measure_iterations, percentile

LOADS = ((256, 1024), (1024, 1024))  # (running decodes, waiting requests)


def cpu_model() -> str:
    """The CPU's model name, as lscpu prints it (its first processor's /proc/cpuinfo entry)."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or platform.machine()


def measure_host(block_size: int, max_model_len: int, iterations: int) -> HostCost:
    """Each of LOADS for `iterations` iterations, at the target's block size and context."""
    if iterations < 2:
        raise ValueError(f"--host-iterations must be 0 (no measurement) or >= 2, got {iterations}")
    load_average = os.getloadavg()[0]
    loads = []
    for running, waiting in LOADS:
        costs = measure_iterations(running, waiting, iterations, running, block_size, max_model_len)
        wall, cpu = costs.wall_ms, costs.cpu_ms
        loads.append(
            HostLoad(
                running=running,
                waiting=waiting,
                iterations=iterations,
                p50_ms=percentile(wall, 50),
                p99_ms=percentile(wall, 99),
                cpu_p50_ms=percentile(cpu, 50),
            )
        )
    return HostCost(cpu_model(), load_average, loads)
