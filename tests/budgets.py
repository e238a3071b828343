"""Hypothesis budgets by profile: `ci` (the default, what `pytest` runs) and `thorough` (ten
times the examples), chosen by JSERVE_HYPOTHESIS_PROFILE and loaded by tests/conftest.py.

A property takes the profile's `max_examples` unless its examples cost far more or far less
than most; then it asks for `examples(n)`: n under `ci`, scaled as the profile scales. The
`slow` variants of properties run the `thorough` budget whatever the profile
(`examples(n, THOROUGH)`), so `pytest -m slow` is the long run.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

PROFILE_ENV = "JSERVE_HYPOTHESIS_PROFILE"
CI, THOROUGH = "ci", "thorough"
_CI_EXAMPLES = 100

settings.register_profile(
    CI,
    max_examples=_CI_EXAMPLES,
    deadline=None,  # an example's first call of a shape compiles
    database=None,  # no example files written into the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.register_profile(THOROUGH, settings.get_profile(CI), max_examples=10 * _CI_EXAMPLES)


def load_profile() -> None:
    """Load the profile JSERVE_HYPOTHESIS_PROFILE names (default `ci`)."""
    name = os.environ.get(PROFILE_ENV, CI)
    if name not in (CI, THOROUGH):
        raise ValueError(f"{PROFILE_ENV} must be {CI!r} or {THOROUGH!r}, got {name!r}")
    settings.load_profile(name)


def examples(ci: int, profile: str | None = None, **overrides: object) -> settings:
    """Settings of `ci` examples under the `ci` profile, scaled to `profile` (default: the
    loaded one); `overrides` set anything else (e.g. stateful_step_count)."""
    base = settings.get_profile(profile) if profile else settings.default
    scaled = max(1, round(ci * base.max_examples / _CI_EXAMPLES))
    return settings(base, max_examples=scaled, **overrides)
