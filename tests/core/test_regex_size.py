"""The unrolled size of a constraint's regexes (jserve.config.regex_size), checked before any
grammar engine: sizes against hand-computed ones, every place a regex in a JSON schema reaches
llguidance searched, realistic regexes served, and StructuredOutputsParams refusing the bombs
(grammars: test_grammar_size.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from jserve.config import regex_size as rs
from jserve.config.regex_size import MAX_REGEX_SIZE, check_json_schema, check_regex, regex_size
from jserve.sampling_params import StructuredOutputsParams

BOMB = "a{1000000}"


@pytest.mark.parametrize(
    ("pattern", "size"),
    [
        ("abc", 3),
        ("a|bc|def", 6),
        (r"[a-z]\d.", 3),
        ("^a$", 3),
        ("a{5}", 5),
        ("a{2,7}", 7),
        ("a{,5}", 5),
        ("a{3,}", 3),
        ("a*", 1),
        ("a?", 1),
        ("a+", 1),
        ("((((((((((((((((a+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+", 1),  # loops are not unrolled
        ("(?:ab|c){10}", 30),
        ("(a{3}b){4}", 16),
        ("(?P<x>a{2})(?=b{3})", 5),
        ("a{2}+", 2),  # Python's possessive; llguidance's (a{2})+
        ("a{2}{3}", 6),  # stacked: llguidance's (a{2}){3}
        ("x(a{10}){10}{10}", 1010),  # stacked counts multiply the whole regex: an upper bound
        (BOMB, 1_000_000),
        ("(a{1000}){1000}", 1_000_000),
        ("(a{100}){100}{100}", 1_000_000),
        ("((ab|cd){10}e){10}", 410),
        ("(a|b){10}", 10),  # Python reads a|b as the class [ab]
        (r"\d{4}-\d{2}-\d{2}", 10),
        # Rust-only spellings, read as Python's of the same size
        (r"\p{L}{3}\pN{2}", 5),
        (r"[\p{Greek}\d]{4}", 4),
        (r"\\p{3}", 4),  # an escaped backslash, then p{3}
        ("(?<year>a{1000}){1000}", 1_000_000),
        (r"(?<=a)b\z", 3),
        ("[[:alpha:]]{3}", 4),  # Python: a class, then `]` three times; an upper bound
    ],
)  # fmt: skip
def test_size_matches_the_hand_computed_bound(pattern, size):
    assert regex_size(pattern).unrolled == size


@pytest.mark.parametrize(
    ("pattern", "written"),
    [("abc", 3), ("(a{3}b){4}", 2), ("(a{100}){100}{100}", 1), ("x(ab|c{9}){2}", 4)],
)
def test_written_size_takes_each_count_once(pattern, written):
    assert regex_size(pattern).written == written


@pytest.mark.parametrize("pattern", ["(unclosed", "a{99999999999}", "[a--b]", "(" * 5000])
def test_a_regex_python_cannot_read_is_left_to_llguidance(pattern):
    assert regex_size(pattern) is None
    check_regex(pattern)  # not refused here


REALISTIC = [
    r"\d{4}-\d{2}-\d{2}",
    "[a-z]{1,64}",
    ".{0,1000}",
    r"[^\n]{0,4000}",
    r"\d{3}-\d{4}",
    r"(\d{1,3}\.){3}\d{1,3}",
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}",
    r"[A-Za-z0-9._%+-]{1,64}@[A-Za-z0-9.-]{1,255}\.[A-Za-z]{2,24}",
    r"^\+?[1-9]\d{1,14}$",
    r"(.|\n)*",
    "(a|b){500}(c|d){500}",
    "^[a-z]+[0-9]{2,4}$",
]


@pytest.mark.parametrize("pattern", REALISTIC)
def test_realistic_regexes_pass(pattern):
    size = regex_size(pattern)
    assert size is not None and size.added <= MAX_REGEX_SIZE
    StructuredOutputsParams(regex=pattern)


@pytest.mark.parametrize("pattern", [BOMB, "(a{1000}){1000}", "(a{100}){100}{100}"])
def test_bombs_are_refused_with_what_to_fix(pattern):
    with pytest.raises(ValueError) as info:
        StructuredOutputsParams(regex=pattern)
    message = str(info.value)
    added = 1_000_000 - regex_size(pattern).written
    assert message == (
        f"the regex {pattern!r} expands to about 1,000,000 nodes once its counted "
        f"repetitions are unrolled, {added:,} more than it writes out; they may add at most "
        f"{MAX_REGEX_SIZE:,}: use + or * or a smaller count"
    )


def test_the_bound_is_inclusive():
    check_regex(f"a{{{MAX_REGEX_SIZE + 1}}}")  # adds MAX_REGEX_SIZE copies to the one written
    with pytest.raises(ValueError, match="expands to about"):
        check_regex(f"a{{{MAX_REGEX_SIZE + 2}}}")


def test_a_long_regex_is_served_and_padding_buys_no_room():
    """What a regex writes out is bounded by its characters, not by this check: a long regex
    without counts is served (as it was before), and neither literals nor blanks around a
    count let it add more."""
    words = "(" + "|".join(f"word{i}x" for i in range(5000)) + ")"  # 43,894 characters
    literal = "abcdefghij" * 3000
    for pattern in (words, literal, literal + "a{2}"):
        assert len(pattern) > MAX_REGEX_SIZE
        check_regex(pattern)
    for padded in ("b" * 25_000 + "a{30000}", "(?x)" + " " * 50_000 + "a{25000}"):
        with pytest.raises(ValueError, match=r"\d more than it writes out; they may add at"):
            check_regex(padded)


def test_a_regex_without_counts_is_not_parsed(monkeypatch):
    """Only counts unroll; a regex without one is passed without the parse's cost."""
    parsed = []
    monkeypatch.setattr(rs, "regex_size", lambda pattern: parsed.append(pattern))
    check_regex("(" + "|".join(f"w{i}" for i in range(9000)) + ")+" + r"\p{L}*")
    check_regex("a{5}")
    assert parsed == ["a{5}"]


def test_too_many_stacked_quantifiers_are_refused():
    stacked = "a" + "{1}" * (rs.MAX_STACKED_QUANTIFIERS + 2)
    with pytest.raises(ValueError, match="stacks more than 4 quantifiers"):
        check_regex(stacked)
    assert regex_size("a" + "{1}" * (rs.MAX_STACKED_QUANTIFIERS + 1)) == (1, 1)
    assert regex_size("a" + "*" * 9) is None  # nothing stacked `*` could add: llguidance reads it
    with pytest.raises(ValueError, match="stacks more than"):  # a count hidden behind them
        regex_size("(a{1000})" + "*" * 9 + "{1000}")


def _schema_at(path: list[str], leaf: dict) -> dict:
    schema = leaf
    for key in reversed(path):
        schema = {key: schema}
    return schema


@pytest.mark.parametrize(
    ("schema", "where"),
    [
        ({"type": "string", "pattern": BOMB}, "at pattern"),
        ({"properties": {"zip": {"type": "string", "pattern": BOMB}}},
         "at properties.zip.pattern"),
        ({"patternProperties": {BOMB: {"type": "string"}}}, "at patternProperties key"),
        ({"propertyNames": {"pattern": BOMB}}, "at propertyNames.pattern"),
        ({"$defs": {"d": {"items": {"anyOf": [{"type": "null"}, {"pattern": BOMB}]}}}},
         "at $defs.d.items.anyOf[1].pattern"),
        ({"properties": {"pattern": {"type": "string", "pattern": BOMB}}},
         "at properties.pattern.pattern"),
    ],
)  # fmt: skip
def test_every_regex_of_a_schema_is_checked(schema, where):
    with pytest.raises(ValueError, match=re.escape(f"the regex {BOMB!r} ({where})")):
        check_json_schema(schema)
    with pytest.raises(ValueError, match="expands to about 1,000,000"):
        StructuredOutputsParams(json=schema)
    text = json.dumps(schema)
    with pytest.raises(ValueError, match="expands to about 1,000,000"):
        StructuredOutputsParams(json=text)


def test_a_long_path_is_cut_in_the_message():
    schema: dict = {"type": "string", "pattern": BOMB}
    for _ in range(60):  # 60,000 characters of names: under MAX_CONSTRAINT_CHARS
        schema = {"properties": {"k" * 1000: schema}}
    with pytest.raises(ValueError) as info:
        check_json_schema(schema)
    message = str(info.value)
    assert len(message) < 400 and "(..." in message and "kkk....pattern)" in message, message


def test_data_in_a_schema_is_not_a_regex():
    data = {"pattern": BOMB}
    check_json_schema({"const": data, "enum": [data], "default": data, "examples": [data]})
    check_json_schema("not JSON {")  # left to the grammar engine's error


def test_a_schema_over_the_length_cap_is_left_to_the_cap(monkeypatch):
    monkeypatch.setattr(rs, "MAX_CONSTRAINT_CHARS", 20)
    check_json_schema({"type": "string", "pattern": BOMB})
    check_regex(BOMB + "b" * 20)


def test_a_bomb_is_refused_without_the_grammar_engine():
    """The check is pure Python below the engine: a process that refuses a bomb has not even
    loaded llguidance, so the refusal costs no compile."""
    script = (
        "import sys\n"
        "from jserve.sampling_params import StructuredOutputsParams\n"
        "try:\n"
        f"    StructuredOutputsParams(regex={BOMB!r})\n"
        "except ValueError as e:\n"
        "    print('refused' if 'expands to about' in str(e) else e)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('llguidance', 'jax')))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert run.stdout.split("\n")[:2] == ["refused", "[]"], run.stderr


_REGEX_PIECES = st.sampled_from(
    ["a", "(", ")", "(?:", "(?<n>", "|", "[", "]", "^", "-", "\\", "\\p{L}", "\\d", "{", "}",
     "{2}", "{3,}", "{,4}", "{1,99}", "*", "+", "?", ".", "9" * 30]
)  # fmt: skip


@given(st.lists(_REGEX_PIECES, max_size=30).map("".join))
def test_any_regex_text_passes_or_gets_a_reason(pattern):
    """Whatever the text, the check returns or raises a ValueError that says what to fix:
    never another exception (which the server would answer with a 500)."""
    try:
        check_regex(pattern)
        check_json_schema({"properties": {"p": {"pattern": pattern}}})
    except ValueError as e:
        assert "expands to about" in str(e) or "stacks more than" in str(e)
