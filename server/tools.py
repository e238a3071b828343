"""OpenAI tool calling on chat: `tools` and `tool_choice` in, `tool_calls` out.

The request side's shapes are Structs (server/protocol_types.py: Tool, ToolChoice); they
become a `ToolRequest` in server/protocol.py.

The model is asked to answer a call as Hermes-style blocks (the format most open chat models
are tuned on, and vLLM's `hermes` parser):

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

- The tools reach the prompt through the chat template when it renders `tools`; a template
  without tool support (SmolLM2's ChatML) gets them in a system message instead
  (`tool_prompt`), stating the format above.
- `tool_choice` "auto": the output is free; the blocks found in it become `tool_calls` and the
  text before them the content. "required" or a named function: the output is constrained by
  a grammar to one (or, with parallel_tool_calls, up to MAX_PARALLEL_CALLS) such blocks whose
  JSON matches a tool's parameters schema, so it always parses, and then ends (EOS is the
  only token after the last block it allows). "none": tools are neither shown nor parsed.
- Output (`split_tool_calls`): call markup never reaches the content. Blocks that parse are
  calls; one cut by max_tokens (or malformed) is dropped, so the calls completed before a cut
  are kept; with parallel_tool_calls false only the first call is returned.
- Streaming (server/openai_format.py): content streams until a block may be starting; the
  calls are sent as `tool_calls` deltas when the choice finishes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jserve.core.stopping import check_stop_strings
from jserve.sampling_params import StructuredOutputsParams
from jserve.server.protocol_types import Role

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
# Calls one "required" request may make with parallel_tool_calls (bounded: a small model at
# temperature 0 repeats its call until max_tokens when the grammar lets it).
MAX_PARALLEL_CALLS = 8
# The call's JSON as the tool prompt shows it: ", " and ": " separators, no other whitespace.
_CALL_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# One block: from its opening tag to its closing tag, the next block's opening tag, or the end.
_CALL_BLOCK = re.compile(
    rf"{re.escape(CALL_OPEN)}\s*(.*?)\s*(?:{re.escape(CALL_CLOSE)}|(?={re.escape(CALL_OPEN)})|$)",
    re.S,
)


class ToolUse(StrEnum):
    """How a request may use its tools: as the model likes, at least one call, or a call of
    the one function its tool_choice names."""

    AUTO = "auto"
    REQUIRED = "required"
    NAMED = "named"


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how it may use them."""

    tools: list[dict[str, Any]]  # OpenAI tool objects ({"type": "function", "function": ...})
    choice: ToolUse
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes "required" and named choices always parse and always end;
        None for auto.

        It ends after the calls it allows (EOS is the only token after the last closing tag):
        one call for a named function or without parallel calls, else at most
        MAX_PARALLEL_CALLS. The JSON has fixed separators (no free whitespace to pad with) and
        each arguments object is closed unless its schema says otherwise (`closed_arguments`),
        so a small model cannot loop inside a call either.
        """
        if self.choice == ToolUse.AUTO:
            return None
        functions = [t["function"] for t in self.tools]
        if self.named is not None:
            functions = [f for f in functions if f["name"] == self.named]
        call = {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f["name"]},
                        "arguments": closed_arguments(f.get("parameters")),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ],
            "x-guidance": _CALL_JSON,
        }
        more = MAX_PARALLEL_CALLS - 1 if self.parallel and self.named is None else 0
        repeat = f' ("\\n" call){{0,{more}}}' if more else ""
        lark = (
            f"start: call{repeat}\n"
            f"call: {json.dumps(CALL_OPEN + chr(10))} body {json.dumps(chr(10) + CALL_CLOSE)}\n"
            f"body: %json {json.dumps(call)}\n"
        )
        return StructuredOutputsParams(grammar=lark)

    @property
    def finish_reason(self) -> str:
        """OpenAI's finish reason when calls were made: "stop" for a named function."""
        return "stop" if self.named is not None else "tool_calls"


def closed_arguments(parameters: dict[str, Any] | None) -> dict[str, Any]:
    """A function's parameters schema with its top-level object closed: no properties beyond
    those it lists unless it says otherwise (`additionalProperties` or `patternProperties`).
    An open object lets a small model add keys until max_tokens."""
    schema = dict(parameters or {"type": "object"})
    if "additionalProperties" not in schema and "patternProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def tool_prompt(tools: list[dict[str, Any]]) -> str:
    """The system text that describes the tools to a template without tool support."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "For each function call, return a json object with function name and arguments "
        f"within {CALL_OPEN}{CALL_CLOSE} XML tags:\n"
        f'{CALL_OPEN}\n{{"name": <function-name>, "arguments": <args-json-object>}}\n{CALL_CLOSE}'
    )


def with_tool_prompt(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict]:
    """`messages` with the tool description added to (or as) the system message."""
    text = tool_prompt(tools)
    if messages and messages[0]["role"] == Role.SYSTEM:
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def calls_as_text(content: str, calls: list[tuple[str, Any]]) -> str:
    """An assistant turn's earlier tool calls, (name, decoded arguments) each, written back as
    blocks of the format above, so the conversation reads to the model as it happened."""
    blocks = [
        f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{CALL_CLOSE}"
        for name, arguments in calls
    ]
    return "\n".join([content, *blocks] if content else blocks)


def split_tool_calls(text: str, *, cut: bool = False) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished output; `cut`: it ended for another reason
    than a stop (max_tokens, a timeout, an abort).

    No call markup reaches the content: it is the text before the first block (of a cut
    output, also without a partial `<tool_call>` at its end). Each block whose JSON parses as
    a call is a call, closing tag or not (a model may end right after the JSON); one that
    does not parse (malformed, or cut before its JSON closed) is dropped.
    """
    start = text.find(CALL_OPEN)
    if start == -1:
        return (text[: streamable_content_end(text)] if cut else text), []
    parsed = (_parse_call(match.group(1)) for match in _CALL_BLOCK.finditer(text, start))
    return text[:start], [call for call in parsed if call is not None]


def _parse_call(body: str) -> dict[str, Any] | None:
    """The OpenAI tool call of one block's JSON, or None if it is not one."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    arguments = call.get("arguments", call.get("parameters", {}))
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {
            "name": call["name"],
            "arguments": json.dumps(arguments, ensure_ascii=False),
        },
    }


def streamable_content_end(text: str) -> int:
    """How much of an unfinished output is safe to stream as content: up to a call block, or
    a partial `<tool_call>` at its end."""
    return check_stop_strings(text, [CALL_OPEN]).end
