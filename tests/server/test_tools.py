"""Tool-call parsing and streaming on hand-written outputs (no model): content before the
blocks, partial tags held back while streaming, calls in the last chunk, bad and cut blocks
dropped without leaking markup, and the grammar that required / named tool_choice compiles
to (it ends after the calls it allows, and its arguments objects are closed)."""

from __future__ import annotations

import json

import pytest

from jserve.outputs import CompletionOutput, FinishReason, RequestOutput
from jserve.server.openai_format import ChoiceCursor, ResponseBuilder
from jserve.server.tools import (
    CALL_OPEN,
    MAX_PARALLEL_CALLS,
    ToolRequest,
    closed_arguments,
    split_tool_calls,
)
from jserve.structured.grammar import GrammarCache

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
CALL1 = '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'
TEXT = f"Let me check.\n{CALL1}\n{CALL2}"


def arguments(calls: list[dict]) -> list[dict]:
    return [json.loads(c["function"]["arguments"]) for c in calls]


def test_split_gives_content_and_calls():
    content, calls = split_tool_calls(TEXT)
    assert content == "Let me check.\n"
    assert arguments(calls) == [{"x": 1}, {"x": 2}]
    assert [c["function"]["name"] for c in calls] == ["f", "f"]
    assert len({c["id"] for c in calls}) == 2 and calls[0]["id"].startswith("call_")
    assert split_tool_calls("no calls") == ("no calls", [])
    unclosed = '<tool_call>\n{"name": "f", "arguments": {}}'  # EOS right after the JSON
    assert arguments(split_tool_calls(unclosed)[1]) == [{}]


@pytest.mark.parametrize(
    ("text", "cut", "content", "expected"),
    [
        # a malformed block is dropped, never shown as content
        ('Hi <tool_call>\n{"name": "f", "arguments": {\n</tool_call>', False, "Hi ", []),
        # max_tokens cut the second call: the first is kept
        (f'{CALL1}\n<tool_call>\n{{"name": "f", "argu', True, "", [{"x": 1}]),
        # cut inside the opening tag of the first call
        ("Sure <tool_ca", True, "Sure ", []),
        # an unclosed block followed by another block: the second still parses
        (f'<tool_call>\n{{"name": "f", "arg\n{CALL2}', False, "", [{"x": 2}]),
        # a stop after a partial tag is text the model chose to end with
        ("a <tool", False, "a <tool", []),
    ],
)
def test_split_drops_cut_and_bad_blocks_and_keeps_the_complete_calls(text, cut, content, expected):
    got_content, calls = split_tool_calls(text, cut=cut)
    assert got_content == content
    assert arguments(calls) == expected


def stream(builder: ResponseBuilder, text: str, reason: FinishReason) -> tuple[str, list, list]:
    """Feed `text` one character per output, as the engine's cumulative outputs; returns the
    streamed content, tool_calls deltas and finish reasons of the chunks."""
    cursor, content, calls, reasons = ChoiceCursor(), "", [], []
    for end in range(1, len(text) + 1):
        done = end == len(text)
        out = CompletionOutput(
            0, text[:end], list(range(end)), finish_reason=reason if done else None
        )
        chunk = builder.delta_chunk(out, cursor)
        if chunk is None:
            continue
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        assert "<" not in content  # not even the start of a tag leaks
        calls += delta.get("tool_calls", [])
        reasons.append(chunk["choices"][0]["finish_reason"])
    return content, calls, reasons


CUT_SECOND = f'Let me check.\n{CALL1}\n<tool_call>\n{{"name": "f", "arguments": {{"x'


@pytest.mark.parametrize(
    ("choice", "named", "parallel", "text", "reason", "want"),
    [
        ("auto", None, True, TEXT, FinishReason.STOP, ("tool_calls", [{"x": 1}, {"x": 2}])),
        ("auto", None, True, CUT_SECOND, FinishReason.LENGTH, ("length", [{"x": 1}])),
        ("auto", None, True, "Let me check.\n<tool_ca", FinishReason.LENGTH, ("length", [])),
        ("auto", None, False, TEXT, FinishReason.STOP, ("tool_calls", [{"x": 1}])),
        ("required", None, True, CALL1, FinishReason.STOP, ("tool_calls", [{"x": 1}])),
        ("named", "f", False, CALL1, FinishReason.STOP, ("stop", [{"x": 1}])),
        ("named", "f", False, CALL1[:30], FinishReason.LENGTH, ("length", [])),
    ],
)
def test_streamed_and_whole_responses_agree_and_never_show_markup(
    choice, named, parallel, text, reason, want
):
    tools = ToolRequest([TOOL], choice, named=named, parallel=parallel)
    builder = ResponseBuilder("chat", "id", "m", tokenizer=None, tools=tools)
    final = CompletionOutput(0, text, [0], finish_reason=reason)
    whole = builder.full_response(RequestOutput("id", None, [], [final], True))["choices"][0]
    content, calls, reasons = stream(builder, text, reason)
    expected_content = text[: text.find(CALL_OPEN)] if CALL_OPEN in text else text
    if reason is FinishReason.LENGTH:
        expected_content = expected_content.removesuffix("<tool_ca")
    finish_reason, expected_calls = want
    assert content == expected_content == (whole["message"]["content"] or "")
    assert arguments(calls) == arguments(whole["message"].get("tool_calls", [])) == expected_calls
    assert [c["index"] for c in calls] == list(range(len(expected_calls)))
    assert reasons[-1] == whole["finish_reason"] == finish_reason
    assert set(reasons[:-1]) <= {None}


def test_closed_arguments_close_only_what_the_schema_leaves_open():
    assert closed_arguments(None) == {"type": "object", "additionalProperties": False}
    open_ = {"type": "object", "properties": {"a": {"type": "string"}}}
    assert closed_arguments(open_) == {**open_, "additionalProperties": False}
    assert "additionalProperties" not in open_  # the request's schema is not changed
    said = {"type": "object", "additionalProperties": {"type": "integer"}}
    assert closed_arguments(said) == said
    patterned = {"type": "object", "patternProperties": {"^x": {"type": "integer"}}}
    assert closed_arguments(patterned) == patterned


@pytest.fixture(scope="module")
def grammars(default_model):
    return GrammarCache(default_model.tokenizer, default_model.config.vocab_size)


Y = {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}  # open
G = {"type": "function", "function": {"name": "g", "parameters": Y}}
ONE = '<tool_call>\n{"name": "g", "arguments": {"y": 3}}\n</tool_call>'
OTHER = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'


def matcher_after(default_model, grammars, tools: ToolRequest, text: str):
    """The tools' grammar after `text`, or None if it refuses `text`."""
    matcher = grammars.template(tools.constraint()).deep_copy()
    return matcher if matcher.consume_tokens(default_model.tokenizer.encode(text)) else None


@pytest.mark.parametrize(
    ("choice", "named", "parallel"),
    [("required", None, True), ("required", None, False), ("named", "g", True)],
)
def test_forced_choice_grammar_accepts_exactly_the_call_format(
    default_model, grammars, choice, named, parallel
):
    tools = ToolRequest([TOOL, G], choice, named=named, parallel=parallel)

    def accepts(text: str) -> bool:
        matcher = matcher_after(default_model, grammars, tools, text)
        return matcher is not None and matcher.is_accepting()

    assert accepts(ONE)
    assert not accepts(ONE.replace('"y": 3', '"y": "3"'))  # arguments follow the schema
    assert not accepts(ONE.replace('"y": 3', '"y": 3, "z": 4'))  # and are closed
    assert not accepts(ONE.replace('{"y": 3}', '{\n  "y": 3\n}'))  # no free whitespace
    assert accepts(f"{ONE}\n{ONE}") == (choice == "required" and parallel)
    assert accepts(OTHER) == (choice == "required")  # a named choice allows only that tool


@pytest.mark.parametrize(
    ("choice", "named", "parallel", "calls"),
    [
        ("named", "g", True, 1),
        ("required", None, False, 1),
        ("required", None, True, MAX_PARALLEL_CALLS),
    ],
)
def test_forced_choice_grammar_ends_after_the_calls_it_allows(
    default_model, grammars, choice, named, parallel, calls
):
    tools = ToolRequest([TOOL, G], choice, named=named, parallel=parallel)
    text = "\n".join([ONE] * calls)
    assert not matcher_after(default_model, grammars, tools, text[:-1]).is_stopped()
    done = matcher_after(default_model, grammars, tools, text)
    assert done.is_stopped() and done.is_accepting()  # only EOS may follow: the engine stops
    assert matcher_after(default_model, grammars, tools, f"{text}\n{ONE}") is None
