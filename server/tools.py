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
  a grammar to one (or, with parallel_tool_calls, several) such blocks whose JSON matches a
  tool's parameters schema, so it always parses. "none": tools are neither shown nor parsed.
- Streaming (server/openai_format.py): content streams until a block may be starting; the
  calls are sent as `tool_calls` deltas when the choice finishes.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from jserve.core.stopping import check_stop_strings
from jserve.sampling_params import StructuredOutputsParams

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL_BLOCK = re.compile(
    re.escape(CALL_OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CALL_CLOSE) + r"|$)", re.S
)


@dataclass(frozen=True)
class ToolRequest:
    """A chat request's tools and how it may use them."""

    tools: list[dict[str, Any]]  # OpenAI tool objects ({"type": "function", "function": ...})
    choice: str  # "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True

    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar that makes "required" and named choices always parse; None for auto."""
        if self.choice == "auto":
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
                        "arguments": f.get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for f in functions
            ]
        }
        repeat = ' ("\\n" call)*' if self.parallel and self.named is None else ""
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
    if messages and messages[0]["role"] == "system":
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


def split_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished output; blocks that do not parse as a call
    stay in the content."""
    start = text.find(CALL_OPEN)
    if start == -1:
        return text, []
    calls = []
    for match in _CALL_BLOCK.finditer(text, start):
        try:
            call = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return text, []
        arguments = call.get("arguments", call.get("parameters", {}))
        calls.append(
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": call["name"],
                    "arguments": json.dumps(arguments, ensure_ascii=False),
                },
            }
        )
    return text[:start], calls


def streamable_content_end(text: str) -> int:
    """How much of an unfinished output is safe to stream as content: up to a call block, or
    a partial `<tool_call>` at its end."""
    return check_stop_strings(text, [CALL_OPEN]).end
