"""Checks of request values at the boundary, shared by the HTTP server and the offline API.

A value is checked in the representation it will be stored in, not only as Python parsed it:
a float must stay finite and inside its range once rounded to float32 (`1e400` parses as inf,
`1e-300` rounds to 0), an integer must fit the int32 (or int64) array it lands in, and a token
id must exist in the model's vocabulary. Every failure is a ValueError whose message names the
field, the value and the allowed range, so a client learns what to fix.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
FLOAT32_MAX = float(np.finfo(np.float32).max)
_SHOWN_CHARS = 60  # a value quoted in an error is cut to this: never echo a whole body back


def excerpt(text: str) -> str:
    """`text`, cut short enough to quote in an error message."""
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def show(value: object) -> str:
    """repr(value), cut short enough for an error message."""
    return excerpt(repr(value))


def is_int(value: object) -> bool:
    """A true integer: bool is an int subclass, but `n=True` is a caller's mistake, not 1."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value: object, lo: int = 0, hi: int = INT32_MAX) -> int:
    """`value` as an int in [lo, hi] (the default range is what an int32 array can hold)."""
    if not is_int(value) or not lo <= value <= hi:  # type: ignore[operator]
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {show(value)}")
    return value  # type: ignore[return-value]


def _range_text(lo: float, hi: float, lo_open: bool) -> str:
    low = f"({lo:g}" if lo_open else f"[{lo:g}"
    return f"{low}, {hi:g}]"


def check_float(
    name: str, value: object, lo: float, hi: float = FLOAT32_MAX, *, lo_open: bool = False
) -> float:
    """`value` as a float that is finite and in [lo, hi] (or (lo, hi]) after float32 rounding."""
    ok = is_int(value) or isinstance(value, float)
    if ok:
        stored = _as_float32(value)  # type: ignore[arg-type]
        ok = math.isfinite(stored) and (lo < stored if lo_open else lo <= stored) and stored <= hi
    if not ok:
        raise ValueError(
            f"{name} must be a finite number in {_range_text(lo, hi, lo_open)} "
            f"(as float32), got {show(value)}"
        )
    return float(value)  # type: ignore[arg-type]


def _as_float32(value: float) -> float:
    try:
        with np.errstate(over="ignore"):
            return float(np.float32(float(value)))
    except OverflowError:  # an int too large for a float
        return math.inf


def check_token_ids(name: str, ids: Sequence[object], vocab_size: int) -> list[int]:
    """`ids` as a list of token ids of a model with `vocab_size` tokens."""
    for i, token in enumerate(ids):
        if not is_int(token) or not 0 <= token < vocab_size:  # type: ignore[operator]
            raise ValueError(
                f"{name}[{i}] must be a token id in [0, {vocab_size}), got {show(token)}"
            )
    return list(ids)  # type: ignore[arg-type]
