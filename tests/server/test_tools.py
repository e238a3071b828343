"""Tool-call parsing and streaming on hand-written outputs (no model): content before the
blocks, partial tags held back while streaming, calls in the last chunk, bad blocks kept as
text, and the grammar that required / named tool_choice compiles to."""

from __future__ import annotations

import json

import pytest

from jserve.outputs import CompletionOutput, FinishReason
from jserve.server.openai_format import ChoiceCursor, ResponseBuilder
from jserve.server.tools import ToolRequest, split_tool_calls
from jserve.structured.grammar import GrammarCache

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TEXT = 'Let me check.\n<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>\n'
TEXT += '<tool_call>\n{"name": "f", "arguments": {"x": 2}}\n</tool_call>'


def test_split_gives_content_and_calls_and_keeps_bad_blocks_as_text():
    content, calls = split_tool_calls(TEXT)
    assert content == "Let me check.\n"
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"x": 1}, {"x": 2}]
    assert len({c["id"] for c in calls}) == 2
    assert split_tool_calls("no calls") == ("no calls", [])
    broken = 'Hi <tool_call>\n{"name": "f", "arguments": {\n</tool_call>'
    assert split_tool_calls(broken) == (broken, [])
    unclosed = '<tool_call>\n{"name": "f", "arguments": {}}'  # cut before its closing tag
    assert split_tool_calls(unclosed)[1][0]["function"]["arguments"] == "{}"


def test_stream_holds_back_tags_and_sends_calls_last():
    builder = ResponseBuilder("chat", "id", "m", tokenizer=None, tools=ToolRequest([TOOL], "auto"))
    cursor, content, calls, reasons = ChoiceCursor(), "", [], []
    for end in range(1, len(TEXT) + 1):
        done = end == len(TEXT)
        out = CompletionOutput(
            0, TEXT[:end], list(range(end)), finish_reason=FinishReason.STOP if done else None
        )
        chunk = builder.delta_chunk(out, cursor)
        if chunk is None:
            continue
        delta = chunk["choices"][0]["delta"]
        content += delta.get("content") or ""
        assert "<" not in content  # not even the start of a tag leaks
        calls += delta.get("tool_calls", [])
        reasons.append(chunk["choices"][0]["finish_reason"])
    assert content == "Let me check.\n"  # as the unstreamed response has it
    assert [c["index"] for c in calls] == [0, 1]
    assert reasons[-1] == "tool_calls" and set(reasons[:-1]) == {None}


@pytest.fixture(scope="module")
def grammars(default_model):
    return GrammarCache(default_model.tokenizer, default_model.config.vocab_size)


@pytest.mark.parametrize(("choice", "named"), [("required", None), ("named", "g")])
def test_forced_choice_grammar_accepts_exactly_the_call_format(
    default_model, grammars, choice, named
):
    y = {"type": "object", "properties": {"y": {"type": "integer"}}, "required": ["y"]}
    g = {"type": "function", "function": {"name": "g", "parameters": y}}
    template = grammars.template(ToolRequest([TOOL, g], choice, named=named).constraint())
    encode = default_model.tokenizer.encode

    def accepts(text: str) -> bool:
        matcher = template.deep_copy()
        return matcher.consume_tokens(encode(text)) and matcher.is_accepting()

    one = '<tool_call>\n{"name": "g", "arguments": {"y": 3}}\n</tool_call>'
    assert accepts(one)
    assert not accepts(one.replace('"y": 3', '"y": "3"'))  # arguments follow the schema
    assert accepts(one + "\n" + one) == (choice == "required")  # parallel calls
    other = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'
    assert accepts(other) == (choice == "required")  # a named choice allows only that tool
