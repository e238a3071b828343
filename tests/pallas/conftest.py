"""A case marked `native_isa(level)` runs its native kernels at that ISA level, or is skipped
with the reason (tests/pallas/native_levels.py); `native_kernels` skips a case that needs the
native kernels at this CPU's own level where they cannot be built."""

from __future__ import annotations

import pytest

from jserve.pallas import native_build
from jserve.pallas.native_build import NativeKernels, NativeKernelsUnavailable
from tests.pallas.native_levels import use_native_level


@pytest.fixture(autouse=True)
def _native_isa(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    if mark := request.node.get_closest_marker("native_isa"):
        use_native_level(monkeypatch, mark.args[0])


@pytest.fixture
def native_kernels() -> NativeKernels:
    """The native kernels at this CPU's level; the case is skipped, saying why, without them."""
    try:
        return native_build.load_or_raise()
    except NativeKernelsUnavailable as e:
        pytest.skip(f"native CPU kernels unavailable: {e}")
