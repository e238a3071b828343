"""Builds and loads the native CPU kernels (`native/*.cc`) once per machine, on first use.

The kernels are XLA FFI handlers compiled with the system C++ compiler against the FFI headers
jaxlib ships, for the CPU they run on (`-march=native`), into jserve's cache directory keyed by
the source, the flags, the compiler and jaxlib, so a change to any of them rebuilds. Without a
compiler, or if the build fails, `load()` returns None with a warning naming why, and the
dispatcher keeps the plain-XLA path: the kernels are a speed-up, never a requirement.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import jax
import jaxlib

from jserve.config.cache_dir import default_cache_dir

log = logging.getLogger(__name__)

NATIVE_DIR = Path(__file__).with_name("native")
SOURCES = tuple(NATIVE_DIR / name for name in ("ragged_attention_cpu.cc", "packed_matmul_cpu.cc"))
HEADERS = (NATIVE_DIR / "parallel_units.h",)  # included by the sources; part of the build key
# Reassociation lets the compiler vectorize dot products; no -ffast-math, whose finite-math
# assumption would break the -inf of the online softmax's first page.
FLAGS = (
    "-std=c++17", "-O3", "-march=native", "-fPIC", "-shared", "-fno-math-errno",
    "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math", "-ffp-contract=fast",
)  # fmt: skip
# name of the FFI target -> symbol of its handler in the library
TARGETS = {
    "jserve_ragged_attention_f32": "JserveRaggedAttentionF32",
    "jserve_packed_matmul_f32": "JservePackedMatmulF32",
}


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("clang++")


def _build(compiler: str, out: Path) -> None:
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        b"\0".join(
            x.encode()
            for x in (
                *(s.read_text() for s in (*SOURCES, *HEADERS)),
                " ".join(FLAGS),
                version,
                jaxlib.__version__,
            )
        )
    ).hexdigest()[:16]
    target = out / f"jserve_cpu_kernels-{key}.so"
    if not target.exists():
        out.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
        cmd = [compiler, *FLAGS, f"-I{jax.ffi.include_dir()}", *map(str, SOURCES), "-o", str(tmp)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            tmp.unlink(missing_ok=True)
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
        tmp.replace(target)  # atomic: concurrent builders never see a half-written library
        log.info("built native CPU kernels into %s", target)
    return target


@functools.cache
def load() -> ctypes.CDLL | None:
    """The native kernel library with its FFI targets registered, or None if it can't be built."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler (g++, clang++ or $CXX): CPU kernels stay on plain XLA")
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler, default_cache_dir() / "native")))
    except (OSError, RuntimeError) as e:
        log.warning("native CPU kernels unavailable, they stay on plain XLA: %s", e)
        return None
    for name, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(library, symbol)), "cpu")
    return library
