"""How large the regexes of an output constraint get once their counted repetitions are unrolled:
a cheap check, before any grammar engine sees them.

llguidance unrolls a counted repetition: `a{1000000}` becomes a million copies of `a`, and
`(a{1000}){1000}` a thousand copies of a thousand. It refuses them in the end (its lexer runs
out of fuel), but only after it has spent CPU-seconds building them on the compile pool. So
every regex a constraint hands to it is measured first, with Python's own regex parser, and
one whose counted repetitions add more than MAX_REGEX_SIZE nodes to those it writes out is
refused at once (a ValueError that says what to fix; StructuredOutputsParams raises it on
construction, which the server turns into a 400 naming the field). What is written out is
bounded by the characters (MAX_CONSTRAINT_CHARS), so a long regex without counts is served,
and neither padding nor comments buy room for counts. docs/architecture.md gives the numbers
behind the bound.

The size (`regex_size`) counts the regex's nodes with its counted repetitions unrolled:
- a literal, a class, `.` or an anchor is 1; a concatenation or an alternation is the sum of
  its parts; a group is its body;
- `x{m,n}` is size(x) * max(n, 1) and `x{m,}` is size(x) * max(m, 1), so `x*`, `x+` and
  `x?` are size(x) (a loop is not unrolled: nested `+` does not double);
- a quantifier on a quantifier (`x{2}{3}`, which llguidance reads as `(x{2}){3}` but Python
  refuses) multiplies the size of the whole regex by its count; Python's possessive `x{2}+`
  is llguidance's `(x{2})+`, sized alike.
llguidance's syntax is Rust's `regex` crate's, which Python's parser mostly shares; before
parsing, the Rust-only spellings that would stop it are rewritten to Python's of the same size
(a Unicode class `\\p{L}` to `.`, a named group `(?<n>...)` to `(?P<n>...)`, `\\z` to `\\Z`).
A regex Python still cannot parse is not refused here; llguidance decides, with its own error.

Where regexes reach llguidance: a regex constraint (`check_regex`); a JSON schema's `pattern`
values and `patternProperties` keys, anywhere in it (`check_json_schema`: `propertyNames`,
`$defs`, `items`, `anyOf`... are walked; `const`, `enum`, `default` and `examples` hold data,
not schemas); a Lark grammar's regex literals and `%json` schemas, and its definitions'
counted repetitions (jserve.config.grammar_size; tool calls' grammars embed the tools'
parameters as `%json`). A constraint longer than MAX_CONSTRAINT_CHARS is not read here: the
engine refuses it by its length, also before llguidance (jserve.structured.grammar).
"""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Iterable, Iterator
from functools import lru_cache
from re import _constants as sre  # type: ignore[attr-defined]  # Python's regex parser's codes
from re import _parser as sre_parse  # type: ignore[attr-defined]
from typing import Any, NamedTuple

from jserve.config.validation import excerpt

# Characters of a constraint's text (JSON schema, regex, Lark/GBNF grammar, or the choices as
# a JSON list): compile time and memory grow with it.
MAX_CONSTRAINT_CHARS = 100_000
# Nodes that unrolling one regex's counted repetitions may add to those it writes out.
MAX_REGEX_SIZE = 20_000
# Characters of a regex's place in a schema quoted in an error (a path can be long).
_WHERE_CHARS = 160
# Quantifiers stacked on quantifiers (`x{2}{3}`) read in one regex; past this, it is refused.
MAX_STACKED_QUANTIFIERS = 4

unbounded = sre.MAXREPEAT  # the upper count of `x*`, `x+` and `x{m,}`
_REPEATS = (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT)  # greedy, lazy, Python's `x*+`
# An escape (taken whole, so `\\p` is not read as `\p`), or the start of a Rust named group.
_RUST_ONLY = re.compile(r"\\[pP](?:\{[^}]*\}|.)?|\\.|\(\?<(?![=!])", re.S)
_QUANTIFIER = re.compile(r"[*+?]|\{(\d*)(?:(,)(\d*))?\}")
# What might be a count (`{2}`, `{2,}`, `{ 2 , 9 }` in verbose mode); an escaped `\{2}` may
# match too, which only costs a parse.
_COUNT = re.compile(r"\{[\d,\s]*\}")
# JSON schema keywords whose values are data, never schemas: not searched for patterns.
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def _as_python(match: re.Match) -> str:
    text = match[0]
    if text[:2] in ("\\p", "\\P"):
        return "."
    return {"(?<": "(?P<", "\\z": "\\Z"}.get(text, text)


def _parse(pattern: str) -> Any:
    """Python's parse (its FutureWarnings on Rust's nested classes, like `[[:alpha:]]`,
    silenced: they warn of Python's future, not of this regex's size)."""
    with warnings.catch_warnings(action="ignore", category=FutureWarning):
        return sre_parse.parse(pattern)


class Size(NamedTuple):
    """The nodes of a regex (or of a Lark definition) with its counted repetitions unrolled,
    and as written, each count taken once: unrolling adds their difference."""

    unrolled: int
    written: int

    @property
    def added(self) -> int:
        return self.unrolled - self.written


ONE = Size(1, 1)


def total(sizes: Iterable[Size]) -> Size:
    """The size of a concatenation or an alternation of parts of these sizes."""
    unrolled = written = 0
    for size in sizes:
        unrolled, written = unrolled + size.unrolled, written + size.written
    return Size(unrolled, written)


def repeat(low: int, high: int, body: Size) -> Size:
    """The size of `body{low,high}` (`high` is `unbounded` for `{low,}`)."""
    return Size(body.unrolled * max(low if high == unbounded else high, 1), body.written)


def _tree_size(items: Any) -> Size:
    """The size of a parsed sequence (a list of (opcode, argument) pairs)."""
    return total(_node_size(op, arg) for op, arg in items)


def _node_size(op: Any, arg: Any) -> Size:
    if op in _REPEATS:
        return repeat(arg[0], arg[1], _tree_size(arg[2]))
    if op is sre.BRANCH:
        return total(_tree_size(branch) for branch in arg[1])
    if op is sre.SUBPATTERN:
        return _tree_size(arg[-1])
    if op is sre.ATOMIC_GROUP:
        return _tree_size(arg)
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        return _tree_size(arg[1])
    if op is sre.GROUPREF_EXISTS:
        return total(_tree_size(branch) for branch in arg[1:] if branch is not None)
    return ONE  # a literal, a class, `.`, an anchor, a back-reference


def _stacked_count(pattern: str, at: int) -> tuple[int, int]:
    """The count of the quantifier at `pattern[at:]` (as it multiplies a size), its length."""
    match = _QUANTIFIER.match(pattern, at)
    if match is None or match[0] == "{}":
        raise ValueError("not a quantifier")
    if match[0] in "*+?":
        return 1, 1
    low = int(match[1] or 0)
    high = unbounded if match[2] and not match[3] else int(match[3] or match[1] or 0)
    return repeat(low, high, ONE).unrolled, len(match[0])


@lru_cache(maxsize=256)
def regex_size(pattern: str) -> Size | None:
    """`pattern`'s size (the rules are in this module's docstring); None when Python's parser
    cannot read it.

    Raises:
        ValueError: more than MAX_STACKED_QUANTIFIERS quantifiers stacked on quantifiers, and
            a count among what is left to read.
    """
    factor, text = 1, _RUST_ONLY.sub(_as_python, pattern)
    for _ in range(MAX_STACKED_QUANTIFIERS + 1):
        try:
            size = _tree_size(_parse(text))
            return Size(factor * size.unrolled, size.written)
        except re.error as e:
            if not e.msg.startswith("multiple repeat") or e.pos is None:
                return None
            try:
                count, length = _stacked_count(text, e.pos)
            except ValueError:
                return None
            factor *= count
            text = text[: e.pos] + text[e.pos + length :]
        except (OverflowError, RecursionError, ValueError):  # e.g. a count past 2**32
            return None
    if _COUNT.search(text) is None:
        return None  # only `*`, `+`, `?` stacked: nothing they could add, left to llguidance
    raise ValueError(
        f"the regex {excerpt(pattern)!r} stacks more than {MAX_STACKED_QUANTIFIERS} "
        "quantifiers on quantifiers (like x{2}{3}); write x{6}, or group them: (?:x{2}){3}"
    )


def too_large(what: str, size: Size) -> ValueError:
    """The refusal of `what` (a regex, a grammar's definition), which unrolls to `size`."""
    return ValueError(
        f"{what} expands to about {size.unrolled:,} nodes once its counted repetitions are "
        f"unrolled, {size.added:,} more than it writes out; they may add at most "
        f"{MAX_REGEX_SIZE:,}: use + or * or a smaller count"
    )


def check_regex(pattern: str, where: str = "") -> None:
    """Refuse `pattern` if unrolling its counted repetitions adds more than MAX_REGEX_SIZE
    nodes to those it writes out.

    Args:
        pattern: the regex, in llguidance's (Rust regex) syntax.
        where: where the constraint holds it, for the message ("" for a regex constraint).

    Raises:
        ValueError: it is too large; the message says how large and what to write instead.
    """
    if len(pattern) > MAX_CONSTRAINT_CHARS:
        return  # refused by its length, before llguidance too
    if _COUNT.search(pattern) is None:
        return  # no count to unroll (`*`, `+`, `?` add nothing): no need to parse it
    size = regex_size(pattern)
    if size is not None and size.added > MAX_REGEX_SIZE:
        if len(where) > _WHERE_CHARS:  # a deep path: its end says the most
            where = "..." + where[3 - _WHERE_CHARS :]
        place = f" ({where})" if where else ""
        raise too_large(f"the regex {excerpt(pattern)!r}{place}", size)


def _schema_patterns(schema: Any) -> Iterator[tuple[str, str]]:
    """(where, regex) for every regex a JSON schema holds; `where` is its path in the schema."""
    stack: list[tuple[str, Any]] = [("", schema)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key, value in node.items():
            name = excerpt(str(key))
            here = f"{path}.{name}" if path else name
            if key == "pattern" and isinstance(value, str):
                yield here, value
            elif key == "patternProperties" and isinstance(value, dict):
                yield from ((f"{here} key", name) for name in value)
            if key not in _DATA_KEYWORDS:
                stack.append((here, value))


def check_json_schema(schema: str | dict, where: str = "") -> None:
    """Refuse a JSON schema (a dict or its JSON text) one of whose regexes is too large (see
    `check_regex`). Text that is not a JSON object is left to the grammar engine's error.

    Raises:
        ValueError: a regex in it is too large; the message gives its path in the schema.
    """
    if isinstance(schema, str):
        if len(schema) > MAX_CONSTRAINT_CHARS:
            return
        try:
            schema = json.loads(schema)
        except (ValueError, RecursionError):
            return
    else:
        try:
            if len(json.dumps(schema)) > MAX_CONSTRAINT_CHARS:
                return
        except (TypeError, ValueError, RecursionError):  # not JSON: the engine says so
            return
    for path, pattern in _schema_patterns(schema):
        check_regex(pattern, f"{where} at {path}" if where else f"at {path}")
