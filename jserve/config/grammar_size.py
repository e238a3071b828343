"""How large a Lark grammar's definitions get once their counted repetitions are unrolled, before
llguidance sees the grammar (jserve.config.regex_size does the same for regexes).

llguidance builds each terminal (an uppercase definition, inlined into one lexer regex with
the terminals it names) and each counted repetition of a rule by unrolling it: `A: "a"{1000000}`
or `A: B{1000}` with `B: "a"{1000}` costs it about a CPU-second before it refuses, as
`/a{1000000}/` does. So a grammar is read here first, with llguidance's own lexeme
definitions (its lark/lexer.rs), so that a `/` or `#` inside a string, a comment or a special
token like `</think>` is not misread:
- every regex literal `/.../flags` and every `%json {...}` schema is checked as a regex
  (`check_regex`) or a schema (`check_json_schema`);
- every definition is sized by the rules of `regex_size` (unrolled, and as written), a
  string, a special token or a `%json` counting 1 and a regex literal its own size; a
  terminal counts the terminals it names at their size, a rule counts a name as 1 (rules are
  not inlined). One whose counts add more than MAX_REGEX_SIZE nodes is refused.
GBNF (which llguidance converts to Lark first) is left to llguidance and its limits, as are
the sizes of a Lark grammar's definitions where it uses syntax this reader does not follow
(`&`, `~` on regexes): its regex literals and `%json` schemas are still checked, and nothing
is refused on the ground of being unread.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from jserve.config import regex_size as limits  # MAX_REGEX_SIZE is declared (and set) there
from jserve.config.regex_size import (
    MAX_CONSTRAINT_CHARS,
    ONE,
    Size,
    check_json_schema,
    check_regex,
    regex_size,
    repeat,
    too_large,
    total,
    unbounded,
)

# llguidance's Lark lexemes (lark/lexer.rs), comments and blanks skipped; `%json`, `%regex`
# and `%llguidance` are each followed by one JSON value.
_LEXEMES = re.compile(
    r"(?P<skip>(?:#|//)[^\n]*|[ \t]+)"
    r"|(?P<newline>(?:\r?\n)+[ \t]*)"
    r'|(?P<string>"(?:\\(?:["\\/bfnrt]|u[a-fA-F0-9]{4})|[^"\\\x00-\x1f\x7f])*"i?)'
    r"|(?P<regex>/(?:\\.|[^/\\])+/)(?P<flags>[imslux]*)"
    r"|(?P<special><[^<>\s]+>)"
    r"|%(?P<keyword>[a-z]+)"
    r"|(?P<name>!?[_?]?[a-zA-Z][\w\-]*)"
    r"|(?P<number>[0-9]+)"
    r"|(?P<ref>@[\w\-]+)"
    r"|(?P<punct>\.\.|->|[:|()\[\]{},~=.+*?-])"
    r"|(?P<other>.)",  # what this reader does not follow (`&`, `@{`): sizes are not read
    re.S,
)
# llguidance reads a grammar as Lark when it has a `start:` rule or `%llguidance`, else as GBNF
# (llguidance.gbnf_to_lark.is_lark_syntax).
_LARK_SYNTAX = re.compile(r"(?m)^\s*(%llguidance\b|start\s*:)")
_SPACE = re.compile(r"\s*")
_ATOMS = frozenset({"string", "special", "ref", "json", "keyword"})  # of size 1


class _Unread(Exception):
    """Syntax this reader does not follow: the grammar is left to llguidance."""


@dataclass
class _Token:
    kind: str
    text: str
    value: Any = None  # a regex literal's pattern, a `%json` schema


def _tokens(grammar: str) -> Iterator[_Token]:
    decoder = json.JSONDecoder()
    at = 0
    while (lexeme := _LEXEMES.match(grammar, at)) is not None:
        at, kind = lexeme.end(), lexeme.lastgroup
        if kind == "flags":
            kind = "regex"
        if kind == "skip":
            continue
        token = _Token(kind, lexeme[0])
        if kind == "regex":
            flags = "(?x)" if "x" in lexeme["flags"] else ""
            token.value = flags + lexeme["regex"][1:-1]
        elif kind == "keyword" and lexeme["keyword"] in ("json", "regex", "llguidance"):
            try:
                token.value, at = decoder.raw_decode(grammar, _SPACE.match(grammar, at).end())
                token.kind = "json" if lexeme["keyword"] == "json" else "keyword"
            except (ValueError, RecursionError):  # llguidance refuses it with its own error
                token.kind = "other"
        yield token


@dataclass
class _Grammar:
    """A Lark grammar's definitions (name to body tokens) and the sizes found so far."""

    bodies: dict[str, list[_Token]]
    sizes: dict[str, Size] = field(default_factory=dict)

    def size(self, name: str) -> Size:
        if name not in self.sizes:
            self.sizes[name] = ONE  # a reference back to a definition being sized: not unrolled
            self.sizes[name] = _Body(self, self.bodies.get(name, []), _is_terminal(name)).size()
        return self.sizes[name]


def _is_terminal(name: str) -> bool:
    return name.lstrip("_").isupper()


def _definitions(tokens: list[_Token]) -> dict[str, list[_Token]]:
    """Each definition's name and body; a statement (`%ignore ...`) is skipped. A body runs to
    the end of its line, and on through the lines after it that start with `|`."""
    bodies: dict[str, list[_Token]] = {}
    statements: list[list[_Token]] = [[]]
    for i, token in enumerate(tokens):
        if token.kind != "newline":
            statements[-1].append(token)
            continue
        j = i + 1  # past the blank and comment lines
        while j < len(tokens) and tokens[j].kind == "newline":
            j += 1
        if j == len(tokens) or tokens[j].text != "|":
            statements.append([])
    for statement in statements:
        if not statement or statement[0].kind != "name":
            continue
        colon = next((j for j, t in enumerate(statement) if t.text == ":"), None)
        if colon is None:
            raise _Unread
        bodies[statement[0].text.lstrip("!?")] = statement[colon + 1 :]
    return bodies


class _Body:
    """The unrolled size of one definition's body, by recursive descent over its tokens."""

    def __init__(self, grammar: _Grammar, tokens: list[_Token], terminal: bool) -> None:
        self.grammar, self.tokens, self.terminal, self.at = grammar, tokens, terminal, 0

    def size(self) -> Size:
        size = self._expansions()
        if self.at != len(self.tokens):
            raise _Unread
        return size

    def _peek(self) -> str | None:
        return self.tokens[self.at].text if self.at < len(self.tokens) else None

    def _take(self) -> _Token:
        if self.at >= len(self.tokens):
            raise _Unread
        self.at += 1
        return self.tokens[self.at - 1]

    def _expansions(self) -> Size:
        alternatives = [self._alternative()]
        while self._peek() == "|":
            self._take()
            alternatives.append(self._alternative())
        return total(alternatives)

    def _alternative(self) -> Size:
        items = []
        while self._peek() not in (None, "|", ")", "]"):
            if self._peek() == "->":  # an alias names the alternative: no size
                self._take(), self._take()
                continue
            items.append(self._item())
        return total(items)

    def _item(self) -> Size:
        size = self._atom()
        while True:
            bounds = self._quantifier()
            if bounds is None:
                return size
            size = repeat(*bounds, size)

    def _atom(self) -> Size:
        token = self._take()
        if token.text in ("(", "["):
            size = self._expansions()
            if self._take().text != {"(": ")", "[": "]"}[token.text]:
                raise _Unread
            return size
        if token.kind == "string" and self._peek() == "..":  # a range "a".."z"
            self._take(), self._take()
            return ONE
        if token.kind in _ATOMS:
            return ONE
        if token.kind == "regex":
            return regex_size(token.value) or ONE
        if token.kind == "name":
            return self.grammar.size(token.text) if self.terminal else ONE
        raise _Unread

    def _quantifier(self) -> tuple[int, int] | None:
        text = self._peek()
        if text in ("?", "*", "+"):
            self._take()
            return {"?": (0, 1), "*": (0, unbounded), "+": (1, unbounded)}[text]
        if text == "~":  # Lark's `x ~ m` and `x ~ m..n`
            self._take()
            low = high = self._number()
            if self._peek() == "..":
                self._take()
                high = self._number()
            return low, high
        if text != "{":
            return None
        self._take()
        low = self._number() if self._peek() != "," else 0
        high = low
        if self._peek() == ",":
            self._take()
            high = self._number() if self._peek() != "}" else unbounded
        if self._take().text != "}":
            raise _Unread
        return low, high

    def _number(self) -> int:
        token = self._take()
        if token.kind != "number" or len(token.text) > 18:  # past a count llguidance reads
            raise _Unread
        return int(token.text)


def check_grammar(grammar: str) -> None:
    """Refuse a Lark grammar one of whose regexes, `%json` schemas or definitions gains more
    than MAX_REGEX_SIZE nodes by unrolling its counted repetitions (see this module's
    docstring).

    Raises:
        ValueError: the message names the regex or the definition, and what to fix.
    """
    if len(grammar) > MAX_CONSTRAINT_CHARS or _LARK_SYNTAX.search(grammar) is None:
        return
    tokens = list(_tokens(grammar))
    for token in tokens:
        if token.kind == "regex":
            check_regex(token.value, "a regex literal of the grammar")
        elif token.kind == "json":
            check_json_schema(token.value, "in a %json schema of the grammar")
    try:
        sized = _Grammar(_definitions(tokens))
        sizes = {name: sized.size(name) for name in sized.bodies}
    except (_Unread, RecursionError):
        return
    name, size = max(sizes.items(), key=lambda item: item[1].added, default=("", ONE))
    if size.added > limits.MAX_REGEX_SIZE:
        kind = "terminal" if _is_terminal(name) else "rule"
        raise too_large(f"the grammar's {kind} {name[:60]!r}", size)
