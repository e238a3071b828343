"""Executables that travel: `jserve compile` writes what it compiles into JAX's persistent
compilation cache, where an engine started with the same flags looks before it compiles.

JAX names an entry by a hash of everything that decides the executable
(`jax._src.cache_key.get`): the lowered program (the step as the engine lowers it, shardings
included), the jaxlib version, the platform and its version string (libtpu's build for a TPU,
the target GPU's name for a compile-only GPU), XLA_FLAGS and LIBTPU_INIT_ARGS, the compile
options (device assignment included, except on GPU) and the topology of the devices. A serving
process computes the same hash from its own devices; when every part is equal it loads the
entry instead of compiling (docs/tpu.md says what must match). An entry is never overwritten,
and a compile-only client cannot load one (JAX warns and compiles), so compiling into a
directory that holds an executable already leaves that entry as it is.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from jserve.runtime.compilation import cache_hit_count, enable_persistent_cache

_SUFFIX = "-cache"  # JAX's file cache stores entry KEY as KEY-cache


class CacheOutcome(StrEnum):
    WROTE = "wrote"  # a new entry (ExecutableReport.cache_entry names its file)
    PRESENT = "already there"  # an entry with its key was there: left as it is
    LOADED = "loaded"  # loaded from the entry instead of compiled (a CPU target)


@dataclass(frozen=True)
class CacheState:
    entries: frozenset[str]
    hits: int


class CompilationCache:
    """JAX's persistent compilation cache in `directory`, for the rest of this process."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = enable_persistent_cache(directory)
        # A compile-only client cannot load an entry; JAX says so for each and compiles anyway.
        warnings.filterwarnings("ignore", ".*PjRtCompiler must be constructed with a Client")

    def state(self) -> CacheState:
        entries = frozenset(p.name for p in self.directory.glob(f"*{_SUFFIX}"))
        return CacheState(entries, cache_hit_count())

    def since(self, before: CacheState) -> tuple[CacheOutcome, str | None]:
        """What became of the one executable compiled since `before`, and the file written."""
        now = self.state()
        written = sorted(now.entries - before.entries)
        if written:
            return CacheOutcome.WROTE, written[0]
        if now.hits > before.hits:
            return CacheOutcome.LOADED, None
        return CacheOutcome.PRESENT, None
