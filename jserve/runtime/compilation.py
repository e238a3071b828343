"""Compilation discipline: the persistent cache, a process-wide compile counter, and warnings.

Every XLA compilation (or load from the persistent cache) in this process is counted. What
happens after warm-up:

1. The model step and the sampler are compiled ahead of time for every bucket, and serving only
   calls those executables: an input outside the buckets raises instead of compiling.
2. The engine is built inside `expect_compilation()` and then calls `mark_serving()`. From then
   on every compilation in the process outside such a block, from any thread, is logged as a
   WARNING that names the compiled function, its argument shapes and the time it took, and is
   counted in `serving_compilation_count()` (exported as `jserve:serving_compilations_total`).
   Serving goes on: a stray compile costs one slow step, not the request.
3. Tests (and benchmarks) wrap code in `forbid_compilation()`, which turns a compile in that
   thread into a `RecompilationError`.

Where the facts come from. JAX records these `jax.monitoring` events around one compilation,
in the compiling thread, each with the keyword `fun_name` (as of jax 0.10.2):
`/jax/core/compile/jaxpr_trace_duration` (the Python function traced, "f"),
`/jax/core/compile/jaxpr_to_mlir_module_duration` ("jit(f)" lowered) and
`/jax/core/compile/backend_compile_duration` ("jit(f)"), which spans XLA's compile or the load
from the persistent cache (inside it: `/jax/compilation_cache/compile_requests_use_cache` and,
on a load, `/jax/compilation_cache/cache_hits`). The counter listens to
`backend_compile_duration` alone, through the public
`jax.monitoring.register_event_duration_secs_listener`: one event per executable, with the
function's name and the duration, is the count, the timing and the name.

No public API names a compilation's argument shapes: the events carry the function's name and
nothing else. The warning's shapes come from the narrowest fallback there is: the record JAX's
lowering writes to its logger `jax._src.interpreters.pxla` ("Compiling <module> with global
shapes and types <avals>", the line `jax_log_compiles` prints), read by a logging filter that
keeps each lowered function's shapes in its thread until that function's compile takes them,
and drops the records the logger would not have printed. Should a JAX version change that record,
the warning says "unknown shapes"; the count, the name and the timing do not depend on it.
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
# The fallback for argument shapes (see the module docstring): JAX's lowering logger and the
# start of the DEBUG record it writes before each lowering.
_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"  # an executable loaded, not compiled
_LOWERING_LOGGER = "jax._src.interpreters.pxla"
_LOWERING_MESSAGE = "Compiling %s with global shapes and types %s"


class _LoweringShapes(logging.Filter):
    """Keeps, per thread, the argument shapes of the functions JAX lowered and has not compiled
    yet, by name (the lowering record's module name is the compile event's `fun_name`), so an
    ahead-of-time `lower()` followed later by `compile()` is still named right.

    JAX only formats that record when its logger is enabled for DEBUG, so the logger is set to
    DEBUG and this filter swallows the records it was not going to print before.
    """

    _KEPT = 16  # lowerings per thread awaiting their compile; older ones are dropped

    def __init__(self, logger: logging.Logger) -> None:
        super().__init__()
        self._passes_from = logger.getEffectiveLevel()
        self._local = threading.local()
        logger.setLevel(logging.DEBUG)
        logger.addFilter(self)

    def _pending(self) -> dict[str, str]:
        pending = getattr(self._local, "pending", None)
        if pending is None:
            pending = self._local.pending = {}
        return pending

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg.startswith(_LOWERING_MESSAGE) and len(record.args) >= 2:
            pending = self._pending()
            pending.pop(str(record.args[0]), None)
            pending[str(record.args[0])] = str(record.args[1])
            if len(pending) > self._KEPT:
                del pending[next(iter(pending))]
        return record.levelno >= self._passes_from

    def take(self, name: str) -> str:
        """The argument shapes of `name`'s lowering in this thread, once."""
        return self._pending().pop(name, None) or "unknown shapes"


class _CompileCounter:
    def __init__(self) -> None:
        self.count = 0
        self.serving_count = 0
        self.serving = False
        self._lock = threading.Lock()
        self._forbidden_in: collections.Counter[int] = collections.Counter()  # compiling = error
        self._expected_in: collections.Counter[int] = collections.Counter()  # warming up
        self._shapes = _LoweringShapes(logging.getLogger(_LOWERING_LOGGER))
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
        name = str(kwargs.get("fun_name", "an unnamed function"))
        shapes = self._shapes.take(name)
        tid = threading.get_ident()
        unexpected = self.serving and tid not in self._expected_in
        with self._lock:
            self.count += 1
            self.serving_count += unexpected
        if unexpected:
            log.warning(
                "compiled %s after warm-up (%.2f s) for arguments %s: an input shape, dtype or "
                "static argument is outside the precompiled buckets",
                name, duration, shapes,
            )  # fmt: skip
        if tid in self._forbidden_in:
            raise RecompilationError(
                f"XLA compiled {name} ({duration:.2f} s) for arguments {shapes} inside "
                "forbid_compilation(): some input shape, dtype or static argument is outside "
                "the precompiled buckets"
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
    """Cache compiled executables on disk so a restart loads them instead of compiling.

    JAX's own XLA caches stay off: by default JAX points XLA's GPU autotuning cache into this
    directory, and that path enters every executable's cache key, so a copy of the directory at
    another path (a serving machine's mount, a CI cache restored elsewhere) would load nothing.
    """
    path = Path(directory).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return path
