"""Is the machine quiet enough for a timing to mean something? (Linux /proc, stdlib only.)

A run is timed as quiet when the 1-minute load average was at most `max_load` before it, and
the CPU seconds that other processes spent while it ran (the machine's busy time from
/proc/stat minus the measured process tree's own) stay below `max_other_share` of one core.
The load after a run is recorded too, but it includes the run itself (an engine that keeps two
cores busy lifts the 1-minute load towards 2), so it is reported, not judged.
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass

from bench.server_stats import process_tree_cpu_seconds


def machine_busy_seconds() -> float:
    """CPU seconds all processors have spent not idle since boot (/proc/stat)."""
    with open("/proc/stat") as stat:
        fields = [int(x) for x in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def wait_for_quiet(max_load: float, timeout_s: float) -> float:
    """Sleep until the 1-minute load is at most `max_load` or `timeout_s` passed; the load."""
    deadline = time.monotonic() + timeout_s
    while os.getloadavg()[0] > max_load and time.monotonic() < deadline:
        time.sleep(2)
    return os.getloadavg()[0]


@dataclass
class Quietness:
    load_before: float
    load_after: float
    own_cpu_s: float  # the measured process tree
    others_cpu_s: float  # everything else on the machine during the run
    wall_s: float

    def verdict(self, max_load: float, max_other_share: float) -> str | None:
        """None if quiet, else why the run's timing is not a result."""
        if self.load_before > max_load:
            return f"1-minute load before the run was {self.load_before:.2f} > {max_load}"
        if self.others_cpu_s > max_other_share * self.wall_s:
            return (
                f"other processes used {self.others_cpu_s:.1f} CPU s during the "
                f"{self.wall_s:.1f} s run (> {max_other_share:.0%} of a core)"
            )
        return None

    def as_dict(self) -> dict:
        return asdict(self)


class QuietMeter:
    """`with QuietMeter(pid) as meter:` ... `meter.result` (a Quietness)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.result: Quietness | None = None

    def __enter__(self) -> QuietMeter:
        self._load = os.getloadavg()[0]
        self._own = process_tree_cpu_seconds(self.pid)
        self._busy = machine_busy_seconds()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        wall = time.perf_counter() - self._t0
        own = process_tree_cpu_seconds(self.pid) - self._own
        others = max(0.0, machine_busy_seconds() - self._busy - own)
        self.result = Quietness(self._load, os.getloadavg()[0], own, others, wall)
