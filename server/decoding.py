"""Decode a request body into its protocol Struct (server/protocol_types.py), or a 400 naming
the field that is wrong.

msgspec does the decoding and the type checks. Its ValidationError carries the path of the bad
value (`$.messages[2].content`), which becomes the error's `param` (`messages[2].content`).
Two refusals carry no path, because msgspec rejects them while reading the JSON text, before
any field: a string holding a lone UTF-16 surrogate (`"\\ud800"`, which no tokenizer can
encode) and the non-JSON literals NaN and Infinity. For those the body is read once more, on
this error path only, by Python's json module, which accepts both, to find and name the field
(`_first_unusable_value`). A number too large for a float (`1e400`) is msgspec's "Number out
of range", and is named the same way when it sits inside a free-form object (a JSON schema).

msgspec's messages quote no input, except a bad enum member's value and an unknown field's
name (where unknown fields are refused): those messages are rewritten to list what is allowed,
read from the Struct's declared types, and to quote at most a short excerpt.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, TypeVar

import msgspec
import msgspec.inspect as mi

from jserve.config.validation import excerpt, show
from jserve.server.api_errors import APIError

T = TypeVar("T")

_STEP = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_ANY_KEY = "..."  # msgspec's step into a dict's value: the key is not named


def decode_request(raw: bytes, kind: type[T]) -> T:
    """`raw` decoded as a `kind` Struct; APIError(400) naming the field otherwise."""
    try:
        return msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as exc:
        raise _invalid_value(str(exc), kind, raw) from None
    except msgspec.DecodeError as exc:
        found = _first_unusable_value(raw)
        if found is not None:
            raise _unusable(*found) from None
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise APIError(400, "request body is not valid JSON: nested too deeply") from None


def _steps(path: str) -> list[str | int]:
    """msgspec's `$.a[2].b` as ["a", 2, "b"] (a dict's value step stays "...")."""
    return [
        name if name else (_ANY_KEY if index == _ANY_KEY else int(index))
        for name, index in _STEP.findall(path)
    ]


def _param(steps: list[str | int]) -> str | None:
    text = "".join(f"[{s}]" if isinstance(s, int) else f".{s}" for s in steps).lstrip(".")
    return text or None


def _invalid_value(text: str, kind: type, raw: bytes) -> APIError:
    head, at, tail = text.rpartition(" - at `")  # msgspec appends the path last
    detail, steps = (head, _steps(tail.rstrip("`"))) if at else (text, [])
    missing = re.fullmatch(r"Object missing required field `(.+)`", detail)
    if missing:
        steps.append(missing[1])
        problem = "is required"
    elif detail == "Number out of range":
        found = _first_unusable_value(raw) if _ANY_KEY in steps else None
        if found is not None:
            return _unusable(*found)
        problem = "must be a finite number"
    elif detail.startswith(("Invalid enum value", "Invalid value")):  # these quote the value
        problem = f"must be one of {_allowed_values(mi.type_info(kind), steps)}"
    elif unknown := re.fullmatch(r"Object contains unknown field `(.*)`", detail, re.S):
        fields = _field_names(mi.type_info(kind), steps)
        problem = f"has an unknown field {show(unknown[1])}; its fields are {fields}"
    else:
        problem = f"is invalid: {detail[:1].lower()}{detail[1:]}"
    if _ANY_KEY in steps:  # inside a free-form object: name the object
        steps = steps[: steps.index(_ANY_KEY)]
    return _unusable(_param(steps) or "", problem)


def _members(info: mi.Type) -> tuple[mi.Type, ...]:
    return info.types if isinstance(info, mi.UnionType) else (info,)


def _child(info: mi.Type, step: str | int) -> mi.Type | None:
    """The declared type at `step` inside a value of type `info`."""
    structs = [t for t in _members(info) if isinstance(t, mi.StructType)]
    if isinstance(step, str) and structs and step == structs[0].tag_field:
        return mi.LiteralType(tuple(t.tag for t in structs))
    for t in _members(info):
        if isinstance(step, int) and isinstance(t, mi.ListType):
            return t.item_type
        if step == _ANY_KEY and isinstance(t, mi.DictType):
            return t.value_type
        if isinstance(step, str) and isinstance(t, mi.StructType):
            for field in t.fields:
                if field.encode_name == step:
                    return field.type
    return None


def _type_at(info: mi.Type | None, steps: list[str | int]) -> mi.Type | None:
    for step in steps:
        info = None if info is None else _child(info, step)
    return info


def _field_names(info: mi.Type, steps: list[str | int]) -> list[str]:
    at = _type_at(info, steps)
    structs = [t for t in _members(at) if isinstance(t, mi.StructType)] if at else []
    return [field.encode_name for t in structs for field in t.fields]


def _allowed_values(info: mi.Type | None, steps: list[str | int]) -> list[Any]:
    """The literal values (enum members, Literal values, union tags) allowed at `steps`."""
    at = _type_at(info, steps)
    values: list[Any] = []
    for t in _members(at) if at is not None else ():
        if isinstance(t, mi.LiteralType):
            values += t.values
        elif isinstance(t, mi.EnumType):
            values += [member.value for member in t.cls]
    return values


def _unusable(path: str, problem: str) -> APIError:
    where = f"'{path}'" if path else "the request body"
    return APIError(400, f"{where} {problem}", param=path or None)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate
        return False
    return True


_SURROGATE = (
    "contains a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape): send valid text"
)


def _first_unusable_value(raw: bytes) -> tuple[str, str] | None:
    """(path, problem) of the first string with a lone surrogate, or number that is not
    finite, in a JSON text msgspec refused; None when there is none, or the text is not JSON
    even to Python's more lenient reader."""
    try:
        tree = json.loads(raw)  # keeps lone surrogates; NaN, Infinity and 1e400 as floats
    except (ValueError, RecursionError):
        return None
    stack: list[tuple[str, Any]] = [("", tree)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str) and not _is_unicode(value):
            return path, _SURROGATE
        if isinstance(value, float) and not math.isfinite(value):
            return path, "must be a finite number (NaN, Infinity and 1e400 are not)"
        if isinstance(value, list):
            stack += [(f"{path}[{i}]", item) for i, item in reversed(list(enumerate(value)))]
        elif isinstance(value, dict):
            for key in value:
                if not _is_unicode(key):
                    return path, f"has a key that {_SURROGATE}"
            named = [(excerpt(key), item) for key, item in value.items()]  # keys are input
            stack += reversed([(f"{path}.{key}" if path else key, item) for key, item in named])
    return None
