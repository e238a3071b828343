"""Builds and loads the native CPU kernels (`native/*.cc`) once per ISA level, on first use.

The kernels are XLA FFI handlers compiled with the system C++ compiler against the FFI headers
jaxlib ships, at the widest ISA level this CPU runs (native_isa: explicit flags, no
`-march=native`). A build lands in `<cache dir>/native/` as `jserve_cpu_kernels-<isa>-<key>.so`,
the key a hash of the sources, the compiler and its version, the flags, the level and the CPU
features it needs, the machine and jaxlib's version, so a change to any of them rebuilds. Next
to it a sidecar `.json` records what the build needs; it is written last, and a library is
only loaded when its sidecar names this build's key and features this CPU has, so a shared
cache never hands a machine code it cannot run (it rebuilds for this CPU instead). Builds run
under a file lock next to the library (two processes starting at once build once) and land by
rename (nobody sees half a library).

Each build registers its handlers under its own FFI target names (`NativeKernels.target`), so
builds at several levels can run in one process (the tests run every level). A build
registers once per process, so the first `load` decides where it is built or found: the
engine's, with its --cache-dir (`jserve.engine.setup`).

Without a compiler, or if the build fails, `load()` returns None with one warning naming why,
and the dispatchers keep the plain-XLA path: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jaxlib

from jserve.config.cache_dir import default_cache_dir
from jserve.pallas import native_isa
from jserve.pallas.native_isa import IsaLevel

log = logging.getLogger(__name__)

HEARTBEAT_S = 5.0  # seconds between progress lines while the compiler runs

NATIVE_DIR = Path(__file__).with_name("native")
SOURCES = tuple(
    NATIVE_DIR / name
    for name in ("ragged_attention_cpu.cc", "packed_matmul_cpu.cc", "quant_matmul_cpu.cc")
)
# included by the sources; part of the build key
HEADERS = tuple(NATIVE_DIR / name for name in ("parallel_units.h", "k_order.h", "float_block.h"))
# Every level's flags; the level adds its own (native_isa). Reassociation lets the compiler
# vectorize dot products; no -ffast-math, whose finite-math assumption would break the -inf of
# the online softmax's first page.
FLAGS = (
    "-std=c++17", "-O3", "-fPIC", "-shared", "-fno-math-errno", "-fassociative-math",
    "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
)  # fmt: skip
# name of the kernel -> symbol of its handler in the library
TARGETS = {
    "jserve_ragged_attention_f32": "JserveRaggedAttentionF32",
    "jserve_ragged_attention_int8": "JserveRaggedAttentionInt8",
    "jserve_packed_matmul_f32": "JservePackedMatmulF32",
    "jserve_quant_matmul_f32": "JserveQuantMatmulF32",
    "jserve_quant_columns_f32": "JserveQuantColumnsF32",
}


class NativeKernelsUnavailable(RuntimeError):
    """Why the native kernels cannot run here: no compiler, a failed build, an unusable cache."""


@dataclass(frozen=True)
class NativeKernels:
    """One loaded build, its handlers registered with XLA."""

    level: IsaLevel
    key: str
    path: Path
    library: ctypes.CDLL = field(repr=False, compare=False)

    def target(self, name: str) -> str:
        """The FFI target the kernel `name` (a key of TARGETS) is registered under."""
        return f"{name}_{self.level.isa}_{self.key}"


@dataclass(frozen=True)
class Build:
    """What one build is: the compiler, the level, its exact flags and the key naming it."""

    compiler: str
    compiler_version: str
    level: IsaLevel
    flags: tuple[str, ...]
    key: str

    @classmethod
    def plan(cls, compiler: str, level: IsaLevel) -> Build:
        done = subprocess.run([compiler, "--version"], capture_output=True, text=True)
        flags = (*FLAGS, *level.flags)
        parts = (
            *(source.read_text() for source in (*SOURCES, *HEADERS)),
            compiler, done.stdout, " ".join(flags), level.isa, " ".join(sorted(level.features)),
            platform.machine(), jaxlib.__version__,
        )  # fmt: skip
        key = hashlib.sha256(b"\0".join(part.encode() for part in parts)).hexdigest()[:16]
        return cls(compiler, done.stdout.partition("\n")[0], level, flags, key)

    def library(self, directory: Path) -> Path:
        return directory / f"jserve_cpu_kernels-{self.level.isa}-{self.key}.so"

    def record(self) -> dict:
        """The sidecar's content: what the library needs and how it was built."""
        return {
            "key": self.key,
            "isa": self.level.isa.value,
            "features": sorted(self.level.features),
            "machine": platform.machine(),
            "flags": list(self.flags),
            "compiler": self.compiler,
            "compiler_version": self.compiler_version,
            "jaxlib": jaxlib.__version__,
        }


def sidecar(library: Path) -> Path:
    return library.with_suffix(".json")


def find_compiler() -> str:
    """$CXX if set (it must name a program), else g++ or clang++ from PATH."""
    if cxx := os.environ.get("CXX"):
        if found := shutil.which(cxx):
            return found
        raise NativeKernelsUnavailable(f"$CXX={cxx} is not a program on this machine")
    if found := shutil.which("g++") or shutil.which("clang++"):
        return found
    raise NativeKernelsUnavailable("no C++ compiler: $CXX is unset and no g++ or clang++ on PATH")


def _usable(build: Build, library: Path) -> bool:
    """Whether `library` is this build, complete, with code this CPU runs (its sidecar says)."""
    try:
        recorded = json.loads(sidecar(library).read_text())
        key, needs = recorded["key"], frozenset(recorded["features"])
    except (OSError, ValueError, KeyError, TypeError):
        return False  # never built here, an interrupted build, or not a sidecar of ours
    return key == build.key and needs <= native_isa.cpu_features() and library.exists()


def _compile(build: Build, library: Path) -> None:
    tmp = library.with_name(f"{library.name}.tmp{os.getpid()}")
    cmd = [build.compiler, *build.flags, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES)]
    started = time.perf_counter()
    log.info(
        "building native CPU kernels (%s) with %s: once per CPU level, compiler and source",
        build.level.isa, build.compiler,
    )  # fmt: skip
    returncode, errors = _run_with_heartbeat([*cmd, "-o", str(tmp)], build.level.isa, started)
    if returncode:
        tmp.unlink(missing_ok=True)
        raise NativeKernelsUnavailable(f"{' '.join(cmd)} failed:\n{errors[-2000:]}")
    tmp.replace(library)
    record = sidecar(library).with_name(f"{sidecar(library).name}.tmp{os.getpid()}")
    record.write_text(json.dumps(build.record(), indent=1))
    record.replace(sidecar(library))  # last: a library counts as built once its sidecar is there
    seconds = time.perf_counter() - started
    log.info("built native CPU kernels (%s) in %.1f s into %s", build.level.isa, seconds, library)


def _run_with_heartbeat(cmd: list[str], isa: str, started: float) -> tuple[int, str]:
    """Run the compiler, logging a line every HEARTBEAT_S while it runs (a start-up is never
    silent for long); its exit code and standard error."""
    with tempfile.TemporaryFile("w+") as errors:
        compiler = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors, text=True)
        while True:
            try:
                compiler.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                so_far = time.perf_counter() - started
                log.info("building native CPU kernels (%s): %.0f s so far", isa, so_far)
        errors.seek(0)
        return compiler.returncode, errors.read()


def built_library(build: Build, directory: Path) -> Path:
    """The build's library in `directory`, compiled there first unless a usable one is there."""
    library = build.library(directory)
    if _usable(build, library):  # no lock: a library is complete once its sidecar is written
        return library
    directory.mkdir(parents=True, exist_ok=True)
    with open(library.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not _usable(build, library):  # another process may have built it while we waited
            _compile(build, library)
    return library


def _open(build: Build, directory: Path) -> NativeKernels:
    path = built_library(build, directory)
    library = ctypes.CDLL(str(path))
    kernels = NativeKernels(build.level, build.key, path, library)
    for name, symbol in TARGETS.items():
        handler = jax.ffi.pycapsule(getattr(library, symbol))
        jax.ffi.register_ffi_target(kernels.target(name), handler, "cpu")
    log.info("native CPU kernels (%s) loaded from %s", build.level.isa, path)
    return kernels


# (compiler, level) -> its loaded build, or why it cannot be: one load per process, since a
# build registers its FFI targets once.
_loaded: dict[tuple[str, IsaLevel], NativeKernels | str] = {}
_loading = threading.Lock()


def load_or_raise(cache_dir: str | Path | None = None) -> NativeKernels:
    """`load`, raising NativeKernelsUnavailable (the reason) where `load` returns None."""
    compiler = find_compiler()
    level = native_isa.choose_level()
    with _loading:
        if (compiler, level) not in _loaded:
            directory = Path(cache_dir or default_cache_dir()) / "native"
            try:
                _loaded[compiler, level] = _open(Build.plan(compiler, level), directory)
            except (NativeKernelsUnavailable, OSError, AttributeError) as e:
                _loaded[compiler, level] = f"{level.isa} build in {directory}: {e}"
        loaded = _loaded[compiler, level]
    if isinstance(loaded, str):
        raise NativeKernelsUnavailable(loaded)
    return loaded


def load(cache_dir: str | Path | None = None) -> NativeKernels | None:
    """The native kernels at this CPU's level (native_isa.choose_level), built if need be under
    `cache_dir` (jserve's cache directory; default: default_cache_dir()) unless this process
    loaded them already; None, with one warning, where they cannot be built or loaded."""
    try:
        return load_or_raise(cache_dir)
    except NativeKernelsUnavailable as e:
        _warn_once(str(e))
        return None


@functools.cache
def _warn_once(reason: str) -> None:
    log.warning("native CPU kernels unavailable, they stay on plain XLA: %s", reason)
