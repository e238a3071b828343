"""Run-time control of the scheduler: read and change its budgets, caps, shares, watermarks
and tenant weights within what was precompiled, and switch the decision log.

A control message is a JSON object of changes. Each field it may hold is declared once, in
`FIELDS`: the SchedulerConfig settings declared `adjustable` (jserve.config.scheduler), with
the type, range and help of that declaration, plus `tenant_weights` and `decision_log`. The
whole message is validated before anything changes (finite numbers, integers an int32 holds,
known choices, at most MAX_TENANT_WEIGHTS weights of declared tenants); a violation is an
InvalidSetting, a ValueError that names the field, and then nothing changed.

The admin endpoint (jserve.server.admin) calls `apply_changes` between steps (on the engine's
step thread). Each applied change is logged at INFO with its old and new value, so a
post-mortem can line up behaviour changes with operator actions. The decision log
(`DECISIONS`, a logger) records at DEBUG why each request was admitted, deferred, preempted or
rejected; it is off unless switched on here or by logging configuration.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from jserve.config.scheduler import SchedulerConfig
from jserve.config.settings import InvalidSetting, check_field, check_value, kind_of
from jserve.config.validation import show
from jserve.core.scheduler import DECISIONS, Scheduler
from jserve.core.step_costs import check_target_itl
from jserve.core.tenants import TenantPolicy, check_tenant_name, check_weight

log = logging.getLogger(__name__)

MAX_TENANT_WEIGHTS = 1024  # entries of one tenant_weights change
_SHOWN_NAME = 64  # an unknown field's name is cut to this in the error's `param`


@dataclass(frozen=True)
class ControlField:
    """One field of a control message: what it takes (for the docs) and its check, which
    returns the value as it is stored or raises InvalidSetting naming the field."""

    name: str
    takes: str
    help: str
    check: Callable[[object], Any]


def _scheduler_field(f: dataclasses.Field) -> ControlField:
    kind, _ = kind_of(f)
    bounds, choices = f.metadata["bounds"], f.metadata["choices"]
    takes = {
        "int": f"integer {bounds}",
        "float": f"finite number {bounds}",
        "str": f"one of {', '.join(choices or ())}",
        "bool": "true or false",
    }[kind]
    return ControlField(f.name, takes, f.metadata["help"], lambda value: check_field(f, value))


def _check_weights(value: object) -> dict[str, float]:
    if not isinstance(value, dict) or len(value) > MAX_TENANT_WEIGHTS:
        raise InvalidSetting(
            "tenant_weights",
            f"tenant_weights must be an object of at most {MAX_TENANT_WEIGHTS} tenant names "
            f"and weights, got {show(value)}",
        )
    try:
        return {check_tenant_name(name): check_weight(name, w) for name, w in value.items()}
    except ValueError as e:
        raise InvalidSetting("tenant_weights", f"tenant_weights: {e}") from None


FIELDS: dict[str, ControlField] = {
    **{
        f.name: _scheduler_field(f)
        for f in dataclasses.fields(SchedulerConfig)
        if f.metadata["adjustable"]
    },
    "tenant_weights": ControlField(
        "tenant_weights",
        f"object of at most {MAX_TENANT_WEIGHTS} declared tenant names to finite numbers > 0",
        "fair-share weights of tenants declared in the tenants file (none can be created here)",
        _check_weights,
    ),
    "decision_log": ControlField(
        "decision_log",
        "true or false",
        "log why each request was admitted, deferred, preempted or rejected (jserve.decisions, "
        "DEBUG)",
        lambda value: check_value("decision_log", value, "bool"),
    ),
}
_SCHEDULER_FIELDS = [name for name in FIELDS if name not in ("tenant_weights", "decision_log")]


def current_settings(scheduler: Scheduler) -> dict[str, Any]:
    """What the admin endpoint shows: the adjustable settings and their current values."""
    settings = {name: getattr(scheduler.config, name) for name in _SCHEDULER_FIELDS}
    settings["tenant_weights"] = dict(scheduler.fair.policy.weights)
    settings["decision_log"] = DECISIONS.isEnabledFor(logging.DEBUG)
    # Read-only: each lane's virtual token counters of its active tenants (top 32 served).
    settings["fair_share_counters"] = {
        lane: dict(sorted(counters.items(), key=lambda kv: -kv[1])[:32])
        for lane, counters in scheduler.fair.counters.items()
        if counters
    }
    return settings


def validate_changes(changes: Mapping[str, Any]) -> dict[str, Any]:
    """Every field of a control message checked as `FIELDS` declares it: the values as they
    will be stored, or InvalidSetting naming the first field that is wrong."""
    for name in changes:
        if name not in FIELDS:
            raise InvalidSetting(
                str(name)[:_SHOWN_NAME],
                f"unknown setting {show(name)}; adjustable: {', '.join(FIELDS)}",
            )
    return {name: FIELDS[name].check(value) for name, value in changes.items()}


def _new_policy(policy: TenantPolicy, weights: dict[str, float] | None) -> TenantPolicy:
    if weights is None:
        return policy
    try:
        return policy.with_weights(weights)
    except ValueError as e:
        raise InvalidSetting("tenant_weights", str(e)) from None


def apply_changes(
    scheduler: Scheduler, changes: Mapping[str, Any], limits: Mapping[str, int]
) -> dict[str, Any]:
    """Validate and apply `changes`; returns the settings after. `limits` holds the largest
    max_num_batched_tokens and max_num_seqs the engine precompiled for. Any error is an
    InvalidSetting naming the field, raised before anything changed."""
    updates = validate_changes(changes)
    weights = updates.pop("tenant_weights", None)
    decision_log = updates.pop("decision_log", None)
    for name, limit in limits.items():
        if name in updates and updates[name] > limit:
            raise InvalidSetting(
                name,
                f"{name}={updates[name]} is above the {limit} the engine precompiled for; "
                f"restart with a larger --{name.replace('_', '-')} to go higher",
            )
    config = dataclasses.replace(scheduler.config, **updates)  # checks across fields
    if scheduler.step_costs is not None:
        check_target_itl(config.target_itl_ms, scheduler.step_costs)
    elif config.target_itl_ms:
        raise InvalidSetting(
            "target_itl_ms", "target_itl_ms needs measured step costs, and this engine has none"
        )
    policy = _new_policy(scheduler.fair.policy, weights)

    before = current_settings(scheduler)
    scheduler.reconfigure(config)  # checks against the KV pool first
    scheduler.fair.policy = policy
    if decision_log is not None:
        DECISIONS.setLevel(logging.DEBUG if decision_log else logging.NOTSET)
    after = current_settings(scheduler)
    for name, value in after.items():
        if name != "fair_share_counters" and value != before[name]:
            log.info("scheduler setting %s changed: %r -> %r", name, before[name], value)
    return after
