"""Settings documented once: each dataclass field's metadata holds its help text, default,
choices and valid range, and the class docstring's "Attributes:" section, the field's
command-line flag and the constructor's checks are all generated from it, so they can never
drift apart (pure Python, no jax).

A setting's value is checked in one place, `check_value`: its type (a bool is not an int, a
float must be finite: JSON's 1e400 parses as inf), its choices and its declared `Bounds`
(integers are also held to what an int64 can store). The flag parser calls it on every flag
and `check_settings` on every field in a settings class's `__post_init__`, which stores each
value as checked (a StrEnum setting's text becomes its member); a failure is an
`InvalidSetting`, a ValueError that names the setting.

A setting with a closed vocabulary declares its choices as a StrEnum and is annotated with
it: the flag, the docs and the errors show the members' values.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from jserve.config.validation import INT32_MAX, INT64_MAX, INT64_MIN, is_int, show

T = TypeVar("T")
_TYPES = {"int": int, "float": float, "str": str}
_NAMED = {INT32_MAX: "2**31-1", INT64_MAX: "2**63-1", INT64_MIN: "-2**63"}
Choices = Sequence[str] | type[StrEnum]


class InvalidSetting(ValueError):
    """A setting's value is wrong; `name` is the setting, the message says what to fix."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(message)
        self.name = name


def _number(value: float) -> str:
    return _NAMED.get(value, str(value)) if is_int(value) else f"{value:g}"


@dataclass(frozen=True)
class Bounds:
    """A numeric setting's valid range: `lo` and `hi` are inclusive unless marked open; None
    leaves that side unbounded (an integer is still held to the int64 range)."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False

    def __post_init__(self) -> None:
        if self.lo is None and self.hi is None:
            raise ValueError("Bounds needs lo, hi or both")

    def __contains__(self, value: float) -> bool:
        lo, hi = self.lo, self.hi
        above = lo is None or (value > lo if self.lo_open else value >= lo)
        below = hi is None or (value < hi if self.hi_open else value <= hi)
        return above and below

    def __str__(self) -> str:
        if self.hi is None and self.lo is not None:
            return f"{'>' if self.lo_open else '>='} {_number(self.lo)}"
        if self.lo is None and self.hi is not None:
            return f"{'<' if self.hi_open else '<='} {_number(self.hi)}"
        low, high = "(["[not self.lo_open], ")]"[not self.hi_open]
        return f"in {low}{_number(self.lo)}, {_number(self.hi)}{high}"  # type: ignore[arg-type]


_INT64 = Bounds(INT64_MIN, INT64_MAX)


def _finite_float(value: object) -> float | None:
    """`value` as a finite float, or None (not a number, a bool, NaN, inf, or an int too
    large for a float)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def check_value(
    name: str,
    value: object,
    kind: str,
    bounds: Bounds | None = None,
    choices: Choices | None = None,
    *,
    optional: bool = False,
) -> Any:
    """`value` as setting `name` of type `kind` ("int", "float", "str" or "bool") holds it
    (an int for a float setting becomes a float, a StrEnum choice its member), or
    InvalidSetting saying what it must be."""
    if value is None and optional:
        return None
    if kind == "bool":
        if isinstance(value, bool):
            return value
        raise InvalidSetting(name, f"{name} must be true or false, got {show(value)}")
    if kind == "str":
        if isinstance(value, str) and (not choices or value in tuple(choices)):
            return choices(value) if isinstance(choices, type) else value
        want = f"one of {', '.join(choices)}" if choices else "a string"
        raise InvalidSetting(name, f"{name} must be {want}, got {show(value)}")
    if kind == "int":
        bounds = bounds or _INT64
        if is_int(value) and value in bounds and value in _INT64:  # type: ignore[operator]
            return value
        raise InvalidSetting(name, f"{name} must be an integer {bounds}, got {show(value)}")
    number = _finite_float(value)
    if number is not None and (bounds is None or number in bounds):
        return number
    within = f" {bounds}" if bounds else ""
    raise InvalidSetting(name, f"{name} must be a finite number{within}, got {show(value)}")


def setting(
    default: Any,
    help: str,
    *,
    vllm: str | None = None,
    default_text: str | None = None,
    choices: Choices | None = None,
    bounds: Bounds | None = None,
    adjustable: bool = False,
) -> Any:
    """A dataclass field with its documentation.

    Args:
        default: the field's default.
        help: what it does, with its unit (one sentence, no trailing period).
        vllm: the vLLM flag it matches, if any.
        default_text: how to describe the default when its value alone says nothing (None).
        choices: the values a string setting accepts: a StrEnum for a closed vocabulary (the
            field is annotated with it and holds its members), or a sequence of strings.
        bounds: the valid range of a numeric setting.
        adjustable: whether it may change at run time (jserve.core.control).
    """
    metadata = {
        "help": help, "vllm": vllm, "default_text": default_text, "choices": choices,
        "bounds": bounds, "adjustable": adjustable,
    }  # fmt: skip
    return dataclasses.field(default=default, metadata=metadata)


def kind_of(f: dataclasses.Field) -> tuple[str, bool]:
    """(type name, whether None is allowed) of a documented field: ("int", True) for
    `int | None`, ("str", False) for a StrEnum setting."""
    text = str(f.type)
    optional = text.endswith(" | None")
    if isinstance(f.metadata["choices"], type):
        return "str", optional
    return text.removesuffix(" | None"), optional


def check_field(f: dataclasses.Field, value: object) -> Any:
    """`value` checked as documented field `f` holds it (see check_value)."""
    kind, optional = kind_of(f)
    meta = f.metadata
    return check_value(f.name, value, kind, meta["bounds"], meta["choices"], optional=optional)


def check_settings(obj: object) -> None:
    """Check every documented field of dataclass instance `obj` and store it as checked (call
    from __post_init__; frozen classes included)."""
    for f in dataclasses.fields(obj):  # type: ignore[arg-type]
        if "help" in f.metadata:
            object.__setattr__(obj, f.name, check_field(f, getattr(obj, f.name)))


def _describe(f: dataclasses.Field, default: str) -> str:
    vllm, bounds = f.metadata["vllm"], f.metadata["bounds"]
    match = f"vLLM: {vllm}" if vllm else "no vLLM equivalent"
    valid = f"; {bounds}" if bounds else ""
    if f.metadata["adjustable"]:
        valid += "; adjustable at run time"
    default = f.metadata["default_text"] or default
    return f"{f.metadata['help']} (default: {default}{valid}; {match})"


def _plain(value: Any) -> Any:
    """A StrEnum member as its text (for docs), anything else as it is."""
    return str(value) if isinstance(value, StrEnum) else value


def documented(cls: type[T]) -> type[T]:
    """Class decorator: append an "Attributes:" section built from the fields' help."""
    lines = [
        f"    {f.name}: {_describe(f, repr(_plain(f.default)))}."
        for f in dataclasses.fields(cls)  # type: ignore[arg-type]
        if "help" in f.metadata
    ]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\nAttributes:\n" + "\n".join(lines) + "\n"
    return cls


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


_FLAG = re.compile(r"--[a-z0-9][a-z0-9-]*")


def flag_names(f: dataclasses.Field) -> list[str]:
    """The flags of documented field `f`: its own, and vLLM's name for it where that is a
    different flag (`--download-dir` for cache_dir), so a vLLM command line keeps working."""
    names = [flag_name(f.name)]
    vllm = f.metadata["vllm"]
    if vllm is not None and _FLAG.fullmatch(vllm) and vllm not in names:
        names.append(vllm)
    return names


def _flag_type(f: dataclasses.Field) -> Any:
    """The argparse `type` of a numeric field: parses the text, then checks the value as the
    constructor will, so a bad flag is a usage error naming the flag."""
    kind, _ = kind_of(f)
    kind_text = "an integer" if kind == "int" else "a number"

    def parse(text: str) -> Any:
        try:
            value = _TYPES[kind](text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {kind_text}") from None
        try:
            return check_field(f, value)
        except InvalidSetting as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    parse.__name__ = kind
    return parse


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per documented field of dataclass `cls` (`--max-num-seqs` for max_num_seqs),
    plus vLLM's name for it where that differs (`flag_names`); help shows the parser's actual
    default, so `set_defaults` on a subcommand stays true."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if "help" not in f.metadata:
            continue
        kind, _ = kind_of(f)
        help_text = (
            _describe(f, "%(default)s").replace("%", "%%").replace("%%(default)s", "%(default)s")
        )
        kwargs: dict[str, Any] = {"default": f.default, "help": help_text}
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif kind == "str":
            kwargs["type"] = str
            if f.metadata["choices"]:
                kwargs["choices"] = [str(choice) for choice in f.metadata["choices"]]
        else:
            kwargs["type"] = _flag_type(f)
        parser.add_argument(*flag_names(f), dest=f.name, **kwargs)


def from_namespace(cls: type[T], ns: argparse.Namespace) -> T:
    """An instance of settings class `cls` from the parsed flags that are its fields."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return cls(**{k: v for k, v in vars(ns).items() if k in names})
