"""The instruction-set levels the native CPU kernels are built at, and the one this CPU runs.

A level is a fixed set of compiler flags and the CPU features its code needs (named as Linux's
/proc/cpuinfo names them). Nothing is built with `-march=native`: a library built at a level
runs on every CPU with the level's features, so a cache shared between machines (an NFS home, a
baked image, a CI cache) holds one library per level and each machine loads the widest it can
run. The sources choose their code paths from the macros the flags define (`__AVX512F__`,
`__AVX512VL__`, `__AVX2__ && __FMA__` (and `__F16C__`), else scalar); tuning stays
`-mtune=generic`, never the build machine's.

On x86-64: "portable" (the x86-64 baseline: the scalar paths), "avx2" (AVX2 + FMA + F16C) and
"avx512" (AVX-512 F + VL, which the sources' AVX-512 blocks use). Elsewhere only "portable":
the compiler's default for the architecture.

`JSERVE_NATIVE_ISA=portable|avx2|avx512` forces a level (the tests run each; an operator can pin
one build for a fleet); a level this CPU cannot run is an error that says so, never a crash.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

ISA_ENV = "JSERVE_NATIVE_ISA"
X86_64_MACHINES = frozenset({"x86_64", "amd64", "AMD64"})  # platform.machine() by OS


class Isa(StrEnum):
    PORTABLE = "portable"
    AVX2 = "avx2"
    AVX512 = "avx512"


@dataclass(frozen=True)
class IsaLevel:
    """A build target: its compiler flags and the CPU features its code needs."""

    isa: Isa
    flags: tuple[str, ...]
    features: frozenset[str]


_X86_BASE = ("-march=x86-64", "-mtune=generic")
_AVX2 = ("-mavx2", "-mfma", "-mf16c")
# What -mavx2 -mfma -mf16c let the compiler emit: AVX2, FMA and F16C (half-precision
# conversions: the scales of GGUF's blocks), and what -mavx2 implies (SSE3 to SSE4.2, POPCNT,
# XSAVE), as /proc/cpuinfo names them ("pni" is SSE3).
_AVX2_NEEDS = frozenset(
    {"pni", "ssse3", "sse4_1", "sse4_2", "popcnt", "xsave", "avx", "avx2", "fma", "f16c"}
)
_X86_64_LEVELS = (
    IsaLevel(Isa.PORTABLE, _X86_BASE, frozenset()),
    IsaLevel(Isa.AVX2, (*_X86_BASE, *_AVX2), _AVX2_NEEDS),
    IsaLevel(
        Isa.AVX512,
        (*_X86_BASE, *_AVX2, "-mavx512f", "-mavx512vl"),
        _AVX2_NEEDS | {"avx512f", "avx512vl"},
    ),
)


def levels(machine: str) -> tuple[IsaLevel, ...]:
    """The levels built for `machine` (platform.machine()'s name), narrowest first."""
    if machine in X86_64_MACHINES:
        return _X86_64_LEVELS
    return (IsaLevel(Isa.PORTABLE, (), frozenset()),)


@functools.cache
def cpu_features() -> frozenset[str]:
    """This CPU's features as Linux lists them (x86 "flags", arm "Features" of /proc/cpuinfo);
    none where there is no /proc/cpuinfo, which leaves only the portable level."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def runnable(level: IsaLevel, features: frozenset[str]) -> bool:
    return level.features <= features


def choose_level() -> IsaLevel:
    """$JSERVE_NATIVE_ISA's level if set (a ValueError if unknown here or beyond this CPU),
    else the widest level this CPU runs."""
    machine, features = platform.machine(), cpu_features()
    here = {level.isa.value: level for level in levels(machine)}
    runs = [name for name, level in here.items() if runnable(level, features)]
    requested = os.environ.get(ISA_ENV)
    if not requested:
        return here[runs[-1]]
    if requested not in here:
        raise ValueError(f"{ISA_ENV}={requested!r}: the levels on {machine} are {', '.join(here)}")
    missing = here[requested].features - features
    if missing:
        raise ValueError(
            f"{ISA_ENV}={requested} needs CPU features this CPU lacks "
            f"({', '.join(sorted(missing))}); unset it or choose one of {', '.join(runs)}"
        )
    return here[requested]
