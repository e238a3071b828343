"""The native kernels' ISA levels as test parameters, and the skip where a level cannot run.

A case parametrized with `NATIVE` runs the "native" implementation once per level of this
machine's architecture (x86-64: portable, avx2, avx512) through `JSERVE_NATIVE_ISA`; a level
this CPU cannot run, or a machine without a C++ compiler, skips the case saying which.
"""

from __future__ import annotations

import functools
import platform

import pytest

from jserve.pallas import native_build, native_isa
from jserve.pallas.native_build import NativeKernels, NativeKernelsUnavailable

LEVELS = [level.isa for level in native_isa.levels(platform.machine())]
NATIVE = [
    pytest.param("native", marks=pytest.mark.native_isa(isa), id=f"native-{isa}") for isa in LEVELS
]


def use_native_level(monkeypatch: pytest.MonkeyPatch, isa: str) -> NativeKernels:
    """Sets JSERVE_NATIVE_ISA=isa and returns that level's kernels, or skips saying why not."""
    level = next(level for level in native_isa.levels(platform.machine()) if level.isa == isa)
    missing = level.features - native_isa.cpu_features()
    if missing:
        pytest.skip(f"this CPU lacks {', '.join(sorted(missing))}, which the {isa} build needs")
    monkeypatch.setenv(native_isa.ISA_ENV, isa)
    try:
        return native_build.load_or_raise()
    except NativeKernelsUnavailable as e:
        pytest.skip(f"native CPU kernels unavailable: {e}")


@functools.cache
def runnable_levels() -> list[str]:
    """The levels whose kernels this machine builds and runs (none without a compiler)."""
    runs = []
    for isa in LEVELS:
        with pytest.MonkeyPatch.context() as monkeypatch:
            try:
                use_native_level(monkeypatch, isa)
            except pytest.skip.Exception:
                continue
        runs.append(isa)
    return runs
