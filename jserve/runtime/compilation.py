"""Compilation discipline: the persistent cache, a process-wide compile counter, and warnings.

Every XLA compilation (or load from the persistent cache) in this process is counted through
JAX's monitoring hook. What happens after warm-up:

1. The model step and the sampler are compiled ahead of time for every bucket, and serving only
   calls those executables: an input outside the buckets raises instead of compiling.
2. The engine is built inside `expect_compilation()` and then calls `mark_serving()`. From then
   on every compilation in the process outside such a block, from any thread, is logged as a
   WARNING that names the compiled function, its argument shapes and the time it took, and is
   counted in `serving_compilation_count()` (exported as `jserve:serving_compilations_total`).
   Serving goes on: a stray compile costs one slow step, not the request.
3. Tests (and benchmarks) wrap code in `forbid_compilation()`, which turns a compile in that
   thread into a `RecompilationError`.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import jax
from jax import monitoring

log = logging.getLogger(__name__)

_BACKEND_COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # an executable loaded, not compiled
# JAX logs "Compiling <name> with global shapes and types <avals>" here before it compiles.
_LOWERING_LOGGER = "jax._src.interpreters.pxla"
_LOWERING_MESSAGE = "Compiling %s with global shapes and types %s"


class _LoweringSignatures(logging.Filter):
    """Remembers, per thread, the argument shapes of the last function JAX lowered.

    JAX only formats that record when its logger is enabled for DEBUG, so the logger is set to
    DEBUG and this filter swallows the records it was not going to print before.
    """

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._passes_from = logger.getEffectiveLevel()
        self._local = threading.local()
        logger.setLevel(logging.DEBUG)
        logger.addFilter(self)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg.startswith(_LOWERING_MESSAGE) and len(record.args) >= 2:
            self._local.signature = str(record.args[1])
        return record.levelno >= self._passes_from

    def last(self) -> str:
        return getattr(self._local, "signature", "unknown shapes")


class _CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self.serving_count = 0
        self.serving = False
        self._lock = threading.Lock()
        self._forbidden_in: collections.Counter[int] = collections.Counter()  # compiling = error
        self._expected_in: collections.Counter[int] = collections.Counter()  # warming up
        self._signatures = _LoweringSignatures(logging.getLogger(_LOWERING_LOGGER))
        monitoring.register_event_duration_secs_listener(self._on_event)
        self.cache_hits = 0
        monitoring.register_event_listener(self._on_cache_event)

    def _on_cache_event(self, event: str, **kwargs: object) -> None:
        if event == _CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def _on_event(self, event: str, duration: float, **kwargs: object) -> None:
        if event != _BACKEND_COMPILE_EVENT:
            return
        name = kwargs.get("fun_name", "an unnamed function")
        tid = threading.get_ident()
        unexpected = self.serving and tid not in self._expected_in
        with self._lock:
            self.count += 1
            self.seconds += duration
            self.serving_count += unexpected
        if unexpected:
            log.warning(
                "compiled %s after warm-up (%.2f s) for arguments %s: an input shape, dtype or "
                "static argument is outside the precompiled buckets",
                name, duration, self._signatures.last(),
            )  # fmt: skip
        if tid in self._forbidden_in:
            raise RecompilationError(
                f"XLA compiled {name} ({duration:.2f} s) for arguments {self._signatures.last()} "
                "inside forbid_compilation(): some input shape, dtype or static argument is "
                "outside the precompiled buckets"
            )


class RecompilationError(RuntimeError):
    """Something compiled where the engine promised it would not."""


COMPILE_COUNTER = _CompileCounter()


def compilation_count() -> int:
    """Compilations (including persistent-cache loads) in this process so far."""
    return COMPILE_COUNTER.count


def cache_hit_count() -> int:
    """Compilations in this process served by the persistent cache (loaded, not compiled)."""
    return COMPILE_COUNTER.cache_hits


def serving_compilation_count() -> int:
    """Compilations since `mark_serving()`: each one is a bug (a shape outside the buckets)."""
    return COMPILE_COUNTER.serving_count


def mark_serving() -> None:
    """Warm-up is over: from now on a compilation outside `expect_compilation()` is a warning."""
    COMPILE_COUNTER.serving = True


@contextlib.contextmanager
def _thread_marked(threads: collections.Counter[int]) -> Iterator[None]:
    tid = threading.get_ident()
    threads[tid] += 1  # a count, so nested blocks unmark only at the outermost exit
    try:
        yield
    finally:
        threads[tid] -= 1
        if not threads[tid]:
            del threads[tid]


def expect_compilation() -> contextlib.ContextDecorator:
    """Compilations in this thread inside the block (or decorated call) are warm-up."""
    return _thread_marked(COMPILE_COUNTER._expected_in)


def forbid_compilation() -> contextlib.ContextDecorator:
    """Raise RecompilationError if anything compiles in this thread inside the block."""
    return _thread_marked(COMPILE_COUNTER._forbidden_in)


def enable_persistent_cache(directory: str | Path) -> Path:
    """Cache compiled executables on disk so a restart loads them in milliseconds."""
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path
