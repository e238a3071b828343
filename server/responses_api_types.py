"""The request body of OpenAI's Responses API (POST /v1/responses), as msgspec Structs.

As for the other endpoints (server/protocol_types.py): decoded once from the raw bytes
(server/decoding.py), unknown fields ignored, types strict, every optional field nullable.
A shape this server cannot serve fails here, with a 400 naming where it is: an input item of
a type other than a message, a function call or a function call's output (reasoning items,
item references, built-in tools' calls), a content part that is not text, a tool that is not a
function (web_search, file_search, mcp, ...). Fields OpenAI defines that jserve cannot honour
are typed so server/responses_api.py can refuse them by name (`REFUSED_FIELDS`).

Beside OpenAI's fields, the sampling extras vLLM's servers take (top_k, min_p, seed,
repetition_penalty, presence/frequency penalties, stop) and jserve's `lane` and `timeout`.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec

from jserve.config.scheduler import Lane
from jserve.config.validation import show
from jserve.server.protocol_types import FunctionNameText, Role, ToolChoiceMode


class ItemType(StrEnum):
    """The input items this server takes (a message may leave out its `type`)."""

    MESSAGE = "message"
    FUNCTION_CALL = "function_call"
    FUNCTION_CALL_OUTPUT = "function_call_output"


class _Body(msgspec.Struct):
    """Base of the body and its parts (unknown fields are ignored)."""


class InputText(_Body):
    """A text part of a message's content: `input_text`, or `output_text` in an assistant
    message sent back."""

    type: str
    text: str | None = None  # required; checked after `type`

    def __post_init__(self) -> None:
        if self.type not in ("input_text", "output_text"):
            raise ValueError(
                f"only text content parts (input_text, output_text) are supported, got type "
                f"{show(self.type)}"
            )
        if self.text is None:
            raise ValueError(f"an {self.type} part needs 'text'")


Content = str | list[InputText]


def _require(item: InputItem, kind: str, *names: str) -> None:
    for name in names:
        if getattr(item, name) is None:
            raise ValueError(f"a {kind} item needs '{name}'")


class InputItem(_Body):
    """One item of `input`: a message (`role` and `content`; `type` "message" or left out),
    a `function_call` an earlier response made (`call_id`, `name`, `arguments`), or a
    `function_call_output` answering one (`call_id`, `output`)."""

    type: str | None = None
    role: Role | None = None
    content: Content | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: Content | None = None
    id: str | None = None
    status: str | None = None

    def __post_init__(self) -> None:
        kind = ItemType.MESSAGE if self.type is None else self.type
        if kind == ItemType.MESSAGE:
            _require(self, "message", "role", "content")
        elif kind == ItemType.FUNCTION_CALL:
            _require(self, "function_call", "call_id", "name", "arguments")
            try:
                msgspec.json.decode(self.arguments or "")
            except msgspec.DecodeError:
                raise ValueError(
                    "'arguments' must be JSON text, e.g. '{\"city\": \"Paris\"}'"
                ) from None
        elif kind == ItemType.FUNCTION_CALL_OUTPUT:
            _require(self, "function_call_output", "call_id", "output")
        else:
            raise ValueError(
                f"input items of type {show(self.type)} are not supported; send one of "
                f"{[t.value for t in ItemType]}"
            )

    @property
    def kind(self) -> ItemType:
        return ItemType.MESSAGE if self.type is None else ItemType(self.type)


class FunctionTool(_Body, omit_defaults=True):
    """A function tool in the Responses shape (flat: no nested `function` object)."""

    type: str
    name: FunctionNameText | None = None  # required; checked after `type`
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type != "function":
            raise ValueError(
                f"only function tools are supported; built-in tools such as {show(self.type)} "
                "are not"
            )
        if self.name is None:
            raise ValueError("a function tool needs 'name'")


class NamedFunction(_Body):
    """tool_choice {"type": "function", "name": ...}."""

    type: Literal["function"]
    name: str


class TextFormatSpec(_Body, omit_defaults=True):
    """`text.format`: {"type": "text"}, {"type": "json_object"}, or {"type": "json_schema",
    "name", "schema", "description", "strict"} (flat, unlike chat's response_format)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None

    def __post_init__(self) -> None:
        if self.type == "json_schema" and self.schema is None:
            raise ValueError("a json_schema format needs 'schema'")


class TextConfig(_Body):
    format: TextFormatSpec | None = None
    verbosity: str | None = None  # a hint for OpenAI's models; accepted and ignored


class ResponsesRequest(_Body, kw_only=True):
    """POST /v1/responses."""

    input: str | Annotated[list[InputItem], msgspec.Meta(min_length=1)]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: ToolChoiceMode | NamedFunction | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None  # None: true, as OpenAI's default
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None
    # Accepted and ignored: they tune OpenAI's own service.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    max_tool_calls: int | None = None  # counts built-in tool calls, which jserve has none of
    # vLLM's sampling extras, and jserve's scheduling fields.
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: str | list[str] | None = None
    lane: Lane | None = None
    priority: int | None = None
    timeout: float | None = None
    # Extra outputs: only OUTPUT_LOGPROBS is served (the others are built-in tools' and
    # reasoning's), with top_logprobs alternatives a token.
    include: list[str] | None = None
    top_logprobs: int | None = None
    # Refused when set (REFUSED_FIELDS): jserve cannot honour them.
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: Literal["auto", "disabled"] | None = None
    context_management: Any = None


OUTPUT_LOGPROBS = "message.output_text.logprobs"  # the `include` entry that asks for logprobs


# Field -> (the value that is as good as absent, why it is refused otherwise).
REFUSED_FIELDS: dict[str, tuple[Any, str]] = {
    "background": (False, "background mode is not supported; send background=false"),
    "reasoning": (None, "reasoning options are not supported: the served models do not reason"),
    "conversation": (None, "conversation objects are not supported; use previous_response_id"),
    "prompt": (None, "stored prompt templates are not supported; send 'input'"),
    "truncation": ("disabled", "truncation 'auto' is not supported; shorten the input"),
    "context_management": (None, "'context_management' is not supported"),
}
