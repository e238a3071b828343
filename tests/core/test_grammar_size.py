"""A Lark grammar read before llguidance (jserve.config.grammar_size): its regex literals and
`%json` schemas found where llguidance's lexer finds them, its definitions' unrolled sizes
against hand-computed ones, and what it does not follow left to llguidance."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.config.grammar_size import check_grammar
from jserve.sampling_params import StructuredOutputsParams
from jserve.server.tools import ToolRequest, ToolUse

BOMB = "a{1000000}"


@pytest.mark.parametrize(
    "grammar",
    [
        f'start: "x" /{BOMB}/',
        f"start: x\nx: /{BOMB}/i",
        f'start: "/" "#" /{BOMB}/',  # quotes hold a `/` and a `#`
        f"start: </think> /{BOMB}/",  # a special token holds a `/`
        f"start: A\nA: /a/ & ~/{BOMB}/",  # regexes are read where definitions are not
        f'start: %json {{"properties": {{"a": {{"pattern": "{BOMB}"}}}}}}',
        f'start: a\na: %json\n  {{"type": "string", "pattern": "{BOMB}"}} "/"',
    ],
)
def test_every_regex_of_a_lark_grammar_is_checked(grammar):
    with pytest.raises(ValueError, match="expands to about 1,000,000"):
        StructuredOutputsParams(grammar=grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        f"start: x\n// /{BOMB}/\n# /{BOMB}/\nx: /[a-z]{{1,64}}/",  # comments
        f'start: "/{BOMB}/"',  # a string, not a regex
        f'start: %regex {{"substring_words": "a / {BOMB} /"}}',
        f'start: %llguidance {{}} "x"\nx: "/{BOMB}/"',
        f'root ::= [a/] "{BOMB}" [/]',  # GBNF: no regex literals
        'start: "a"{3} /[0-9]{2,4}/ "/" /\\/+/',
    ],
)
def test_what_is_not_a_regex_literal_is_not_read_as_one(grammar):
    check_grammar(grammar)
    StructuredOutputsParams(grammar=grammar)


@pytest.mark.parametrize(
    ("grammar", "what", "size"),
    [
        ('start: A\nA: "a"{1000000}', "terminal 'A'", "1,000,000"),
        ("start: A\nA: /a{1000}/{1000}", "terminal 'A'", "1,000,000"),
        ('start: A\nA: B{1000}\nB: "a"{1000}', "terminal 'A'", "1,000,000"),  # inlined
        ("start: a\na: /a{1000}/{1000}", "rule 'a'", "1,000,000"),
        ('start: x\n  // a comment line\n  | y\nx: "a"\ny: /b{100}/ ~ 300', "rule 'y'", "30,000"),
        ('start: ("a" | "b" [C]){2}{15000}\nC: "c"', "rule 'start'", "90,000"),
        ("// " + "x" * 50_000 + '\nstart: A\nA: "a"{30000}', "terminal 'A'", "30,000"),  # padded
    ],
)  # fmt: skip
def test_definitions_that_unroll_too_far_are_refused(grammar, what, size):
    with pytest.raises(ValueError, match=f"the grammar's {what} expands to about {size} nodes"):
        StructuredOutputsParams(grammar=grammar)


@pytest.mark.parametrize(
    "grammar",
    [
        'start: x{1000}\nx: "a"{1000}',  # a rule is named, not inlined: 1,000 each
        "start: A\nA: /" + "abcdefghij" * 3000 + "/",  # long, but written out: its length
        "start: c\nc: " + " | ".join(f'"w{i}"' for i in range(3000)),
        'start: <think> /(.|\\n){1000,3000}/ </think> %json {"type": "object"}',
        'start: A\nA: "a".."z"{5} -> letters\n%ignore /[ \\t]+/\n%import common.WS',
        'g[stop="\\n", max_tokens=10, temperature=0.7]: /.*/\nstart: g{20000}',
        "start: A\nA: /a/ & ~/b{100}/{300}",  # `&` is past this reader: llguidance decides
        "start: %json " + "[" * 50_000,  # JSON too deep to read: llguidance decides
    ],
)
def test_grammars_within_the_bound_or_past_the_reader_pass(grammar):
    check_grammar(grammar)


def test_a_forced_tool_call_grammar_is_read_and_passes():
    parameters = {"type": "object", "properties": {"city": {"type": "string", "pattern": BOMB}}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    with pytest.raises(ValueError, match="in a %json schema of the grammar at anyOf"):
        ToolRequest(tools, ToolUse.REQUIRED).constraint()
    parameters["properties"]["city"]["pattern"] = "[A-Z][a-z]{1,40}"
    assert ToolRequest(tools, ToolUse.REQUIRED).constraint() is not None


_GRAMMAR_PIECES = st.sampled_from(
    ["start: ", "A: ", "a: ", "\n", "\n  | ", '"x"', '"/"', "/b{30}/", "/[a-z]/i", "A", "a",
     "(", ")", "[", "]", "{", "}", "2", "300", ",", "~", "..", "|", "*", "+", "?", "&", "#",
     "//", "<x/>", "%json", " {}", ' {"pattern": "c{9}"}', "%ignore ", "->", "@g", "9" * 30]
)  # fmt: skip


@given(st.lists(_GRAMMAR_PIECES, max_size=40).map("".join))
def test_any_grammar_text_passes_or_gets_a_reason(grammar):
    """Whatever the text, the check returns or raises a ValueError that says what is too large:
    never another exception (which the server would answer with a 500)."""
    try:
        check_grammar("start: x\n" + grammar)
    except ValueError as e:
        assert "expands to about" in str(e)
