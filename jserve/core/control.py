"""Run-time control of the scheduler: read and change its budgets, caps, shares, watermarks
and tenant weights within what was precompiled, and switch the decision log.

The admin endpoint (jserve.server.admin) calls `apply_changes` between steps (on the engine's step
thread). Every change is validated first (a ValueError says what to fix and changes nothing),
then logged at INFO with its old and new value, so a post-mortem can line up behaviour changes
with operator actions. The decision log (`DECISIONS`, a logger) records at DEBUG why each
request was admitted, deferred, preempted or rejected; it is off unless switched on here or by
logging configuration.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping
from typing import Any

from jserve.core.scheduler import DECISIONS, Scheduler
from jserve.core.step_costs import check_target_itl

log = logging.getLogger(__name__)

# SchedulerConfig fields that may change at run time, with the JSON type each takes.
ADJUSTABLE: dict[str, type] = {
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "long_prefill_token_threshold": int,
    "long_lane_max_share": float,
    "free_block_watermark": float,
    "kv_reject_watermark": float,
    "aging_iterations": int,
    "fairness": str,
    "deadline_admission": bool,
    "target_itl_ms": float,
}
_EXTRA = ("tenant_weights", "decision_log")


def current_settings(scheduler: Scheduler) -> dict[str, Any]:
    """What the admin endpoint shows: the adjustable settings and their current values."""
    settings: dict[str, Any] = {name: getattr(scheduler.config, name) for name in ADJUSTABLE}
    settings["tenant_weights"] = dict(scheduler.fair.policy.weights)
    settings["decision_log"] = DECISIONS.isEnabledFor(logging.DEBUG)
    # Read-only: each lane's virtual token counters of its active tenants (top 32 served).
    settings["fair_share_counters"] = {
        lane: dict(sorted(counters.items(), key=lambda kv: -kv[1])[:32])
        for lane, counters in scheduler.fair.counters.items()
        if counters
    }
    return settings


def _checked_type(name: str, value: Any, kind: type) -> Any:
    ok = isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
    if kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok:
        raise ValueError(f"{name} must be {kind.__name__}, got {value!r}")
    return kind(value)


def apply_changes(
    scheduler: Scheduler, changes: Mapping[str, Any], limits: Mapping[str, int]
) -> dict[str, Any]:
    """Validate and apply `changes`; returns the settings after. `limits` holds the largest
    max_num_batched_tokens and max_num_seqs the engine precompiled for."""
    unknown = sorted(set(changes) - set(ADJUSTABLE) - set(_EXTRA))
    if unknown:
        raise ValueError(f"unknown settings {unknown}; adjustable: {[*ADJUSTABLE, *_EXTRA]}")
    updates = {
        name: _checked_type(name, value, ADJUSTABLE[name])
        for name, value in changes.items()
        if name in ADJUSTABLE
    }
    for name, limit in limits.items():
        if name in updates and updates[name] > limit:
            raise ValueError(
                f"{name}={updates[name]} is above the {limit} the engine precompiled for; "
                f"restart with a larger --{name.replace('_', '-')} to go higher"
            )
    config = dataclasses.replace(scheduler.config, **updates)  # validates
    if scheduler.step_costs is not None:
        check_target_itl(config.target_itl_ms, scheduler.step_costs)
    elif config.target_itl_ms:
        raise ValueError("target_itl_ms needs measured step costs, and this engine has none")
    policy = scheduler.fair.policy
    weights = changes.get("tenant_weights")
    if weights is not None:
        if not isinstance(weights, dict):
            raise ValueError(f"tenant_weights must be an object of name: weight, got {weights!r}")
        policy = policy.with_weights(weights)
    decision_log = changes.get("decision_log")
    if decision_log is not None and not isinstance(decision_log, bool):
        raise ValueError(f"decision_log must be true or false, got {decision_log!r}")

    before = current_settings(scheduler)
    scheduler.reconfigure(config)
    scheduler.fair.policy = policy
    if decision_log is not None:
        DECISIONS.setLevel(logging.DEBUG if decision_log else logging.NOTSET)
    after = current_settings(scheduler)
    for name, value in after.items():
        if name != "fair_share_counters" and value != before[name]:
            log.info("scheduler setting %s changed: %r -> %r", name, before[name], value)
    return after
