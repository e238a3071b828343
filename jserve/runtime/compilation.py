"""Compilation discipline: the persistent cache, a process-wide compile counter, and a guard.

Every XLA compilation (or load from the persistent cache) in this process is counted through
JAX's monitoring hook. After warm-up the engine serves inside `forbid_compilation()`, so a shape
that slipped past the precompiled buckets fails loudly instead of stalling a step for a second.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
from jax import monitoring

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class _CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._lock = threading.Lock()
        self._forbidden_in: set[int] = set()  # thread ids where compiling is an error
        monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **_: object) -> None:
        if event != _BACKEND_COMPILE_EVENT:
            return
        with self._lock:
            self.count += 1
            self.seconds += duration
        if threading.get_ident() in self._forbidden_in:
            raise RecompilationError(
                f"XLA compiled a new executable ({duration:.2f} s) after warm-up: some input "
                "shape, dtype or static argument is outside the precompiled buckets"
            )


class RecompilationError(RuntimeError):
    """Something compiled where the engine promised it would not."""


COMPILE_COUNTER = _CompileCounter()


def compilation_count() -> int:
    """Compilations (including persistent-cache loads) in this process so far."""
    return COMPILE_COUNTER.count


@contextlib.contextmanager
def forbid_compilation() -> Iterator[None]:
    """Raise RecompilationError if anything compiles in this thread inside the block."""
    tid = threading.get_ident()
    COMPILE_COUNTER._forbidden_in.add(tid)
    try:
        yield
    finally:
        COMPILE_COUNTER._forbidden_in.discard(tid)


def enable_persistent_cache(directory: str | Path) -> Path:
    """Cache compiled executables on disk so a restart loads them in milliseconds."""
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
