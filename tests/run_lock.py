"""A lock that the pytest-xdist workers of one run share, for work the run needs done once.

Each worker has its own session fixtures, so a costly one (a process to start, steps to
compile) runs on every worker that asks for it, at the same time if they ask at once. Under
`run_lock` the workers take turns: the first does the work and leaves its result in the
run's shared directory (a report, compiled steps in the persistent compilation cache), and
the others find it there.
"""

from __future__ import annotations

import contextlib
import fcntl
from collections.abc import Iterator
from pathlib import Path

import pytest


@contextlib.contextmanager
def run_lock(tmp_path_factory: pytest.TempPathFactory, worker_id: str, name: str) -> Iterator[Path]:
    """Holds the run's lock `name` and yields the run's shared directory: the workers' common
    temporary parent under pytest-xdist, this process's own temporary base without it."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        yield shared
