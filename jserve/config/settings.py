"""Settings documented once: each dataclass field's metadata holds its help text, and both the
class docstring's "Attributes:" section and the field's command-line flag are generated from
it, so the two can never drift apart (pure Python, no jax).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any, TypeVar

T = TypeVar("T")
_TYPES = {"int": int, "float": float, "str": str}


def setting(
    default: Any,
    help: str,
    *,
    vllm: str | None = None,
    default_text: str | None = None,
    choices: Sequence[str] | None = None,
) -> Any:
    """A dataclass field with its documentation.

    Args:
        default: the field's default.
        help: what it does, with its unit (one sentence, no trailing period).
        vllm: the vLLM flag it matches, if any.
        default_text: how to describe the default when its value alone says nothing (None).
        choices: the values a flag accepts.
    """
    metadata = {"help": help, "vllm": vllm, "default_text": default_text, "choices": choices}
    return dataclasses.field(default=default, metadata=metadata)


def _describe(f: dataclasses.Field, default: str) -> str:
    vllm = f.metadata["vllm"]
    match = f"vLLM: {vllm}" if vllm else "no vLLM equivalent"
    return f"{f.metadata['help']} (default: {f.metadata['default_text'] or default}; {match})"


def documented(cls: type[T]) -> type[T]:
    """Class decorator: append an "Attributes:" section built from the fields' help."""
    lines = [
        f"    {f.name}: {_describe(f, repr(f.default))}."
        for f in dataclasses.fields(cls)
        if "help" in f.metadata
    ]
    cls.__doc__ = (cls.__doc__ or "").rstrip() + "\n\nAttributes:\n" + "\n".join(lines) + "\n"
    return cls


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, cls: type) -> None:
    """One flag per documented field of dataclass `cls` (`--max-num-seqs` for max_num_seqs);
    help shows the parser's actual default, so `set_defaults` on a subcommand stays true."""
    for f in dataclasses.fields(cls):
        if "help" not in f.metadata:
            continue
        kind = str(f.type).removesuffix(" | None")
        help_text = (
            _describe(f, "%(default)s").replace("%", "%%").replace("%%(default)s", "%(default)s")
        )
        kwargs: dict[str, Any] = {"default": f.default, "help": help_text}
        if kind == "bool":
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = _TYPES[kind]
            if f.metadata["choices"]:
                kwargs["choices"] = list(f.metadata["choices"])
        parser.add_argument(flag_name(f.name), **kwargs)
