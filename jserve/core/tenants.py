"""Tenants: who a request is served for, and each tenant's weight and cap.

A request's tenant is a short name (the HTTP server takes it from the `X-Tenant` header or the
OpenAI `user` field; `DEFAULT_TENANT` otherwise). Tenants need no declaration: an undeclared
one gets weight 1 and no cap. A tenants file (`--tenants-file`, JSON) declares weights and caps:

    {"tenants": {"alice": {"weight": 2.0, "max_running": 8}, "bob": {"weight": 1.0}}}

`weight` (> 0) scales the tenant's fair share: a tenant of weight 2 is served twice the tokens
of a tenant of weight 1 while both are backlogged (jserve.core.fairness). `max_running` (>= 1)
caps how many of its sequences run at once. The run-time admin endpoint may change the weights
of declared tenants only, so an operator's typo cannot create a tenant.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jserve.config.settings import Bounds, check_value
from jserve.config.validation import show

DEFAULT_TENANT = "default"
MAX_TENANT_NAME = 256  # OpenAI clients send user ids of up to this length
_TENANT_KEYS = frozenset({"weight", "max_running"})
_WEIGHTS = Bounds(0.0, lo_open=True)
_SHOWN_NAMES = 5  # unknown tenants an error lists


def check_tenant_name(name: object) -> str:
    """`name` if it is a usable tenant name, else a ValueError saying what is wrong."""
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_TENANT_NAME:
        raise ValueError(
            f"a tenant name must be a string of 1 to {MAX_TENANT_NAME} characters, got {show(name)}"
        )
    if not name.isprintable():
        raise ValueError(f"tenant name {show(name)} contains unprintable characters")
    return name


def check_weight(tenant: str, weight: object) -> float:
    """`weight` as a float if it is a finite number > 0, else a ValueError naming `tenant`."""
    return check_value(f"tenant {tenant!r}: weight", weight, "float", _WEIGHTS)


@dataclass(frozen=True)
class TenantPolicy:
    """Declared tenants' weights and running-sequence caps (undeclared: weight 1, no cap)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    max_running: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for tenant, weight in self.weights.items():
            check_weight(check_tenant_name(tenant), weight)
        for tenant, cap in self.max_running.items():
            check_tenant_name(tenant)
            if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
                raise ValueError(
                    f"tenant {tenant!r}: max_running must be an integer >= 1, got {cap!r}"
                )
            if tenant not in self.weights:
                raise ValueError(f"tenant {tenant!r} has a cap but no weight entry")

    @property
    def tenants(self) -> tuple[str, ...]:
        """Declared tenants, in the file's order."""
        return tuple(self.weights)

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def with_weights(self, changes: Mapping[str, Any]) -> TenantPolicy:
        """A copy with some declared tenants' weights changed (ValueError on an unknown one)."""
        unknown = sorted(set(changes) - set(self.weights))
        if unknown:
            declared = _listed(list(self.weights)) if self.weights else "none"
            raise ValueError(
                f"unknown tenants {_listed(unknown)}: only the tenants declared in the tenants "
                f"file ({declared}) have weights to change"
            )
        weights = dict(self.weights)
        for tenant, weight in changes.items():
            weights[tenant] = check_weight(tenant, weight)
        return TenantPolicy(weights, self.max_running)


def _listed(names: list[str]) -> str:
    """The first few names and how many more: an error must not echo a huge list back."""
    more = len(names) - _SHOWN_NAMES
    return str(names[:_SHOWN_NAMES]) + (f" and {more} more" if more > 0 else "")


def parse_tenant_policy(data: object, source: str = "tenants file") -> TenantPolicy:
    """The policy a tenants file's JSON describes; ValueError naming what to fix."""
    if (
        not isinstance(data, dict)
        or set(data) != {"tenants"}
        or not isinstance(data["tenants"], dict)
    ):
        raise ValueError(f'{source}: expected {{"tenants": {{NAME: {{"weight": W}}, ...}}}}')
    weights: dict[str, float] = {}
    caps: dict[str, int] = {}
    for tenant, entry in data["tenants"].items():
        check_tenant_name(tenant)
        if not isinstance(entry, dict):
            raise ValueError(f"{source}: tenant {tenant!r} must map to an object, got {entry!r}")
        unknown = sorted(set(entry) - _TENANT_KEYS)
        if unknown:
            raise ValueError(
                f"{source}: tenant {tenant!r} has unknown keys {unknown}; allowed: "
                f"{sorted(_TENANT_KEYS)}"
            )
        weights[tenant] = entry.get("weight", 1.0)
        if "max_running" in entry:
            caps[tenant] = entry["max_running"]
    try:
        return TenantPolicy(weights, caps)
    except ValueError as exc:
        raise ValueError(f"{source}: {exc}") from None


def load_tenant_policy(path: str | None) -> TenantPolicy:
    """The tenants file at `path` (None: no declared tenants)."""
    if path is None:
        return TenantPolicy()
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the tenants file {path}: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"the tenants file {path} is not valid JSON: {exc}") from None
    return parse_tenant_policy(data, f"tenants file {path}")


class TenantLabels:
    """Bounded metric labels: declared tenants and the first `max_labels` others keep their
    names, later ones are reported as "other" (a client-chosen `user` field must not be able to
    create unbounded metric series)."""

    OTHER = "other"

    def __init__(self, declared: tuple[str, ...] = (), max_labels: int = 32) -> None:
        if max_labels < 0:
            raise ValueError(f"max_labels must be >= 0, got {max_labels}")
        self._labels = {tenant: tenant for tenant in (DEFAULT_TENANT, *declared)}
        self._free = max_labels

    def __call__(self, tenant: str) -> str:
        label = self._labels.get(tenant)
        if label is None:
            label = tenant if self._free > 0 and tenant != self.OTHER else self.OTHER
            if label != self.OTHER:
                self._free -= 1
                self._labels[tenant] = label
        return label
