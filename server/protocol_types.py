"""The request bodies of the OpenAI-compatible API, as msgspec Structs.

A body is decoded once, from its raw bytes, into one of these (server/decoding.py), so every
field has one declared type and one place where it is read. OpenAI's field names, plus vLLM's
extensions; unknown fields are ignored, as OpenAI-compatible servers do. Types are strict (a
bool is not an int, a string is not a number), and every optional field is nullable with the
default applied later (server/protocol.py), since OpenAI treats an explicit null as absent.
Value ranges are not declared here: SamplingParams checks them (jserve/sampling_params.py),
for the offline API too.

jserve's own fields: `lane` (the scheduling lane) and `timeout` (seconds: the request's
deadline). The fields jserve cannot honour (echo on chat, suffix, best_of != n, functions,
tools on completions) are typed so that server/protocol.py can refuse them with a
400 rather than ignore them.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Annotated, Any, Literal

import msgspec

from jserve.config.scheduler import Lane
from jserve.config.validation import show


class Role(StrEnum):
    """OpenAI's message roles ("function" is its deprecated name for "tool")."""

    SYSTEM = "system"
    DEVELOPER = "developer"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"
    FUNCTION = "function"


class ToolChoiceMode(StrEnum):
    NONE = "none"
    AUTO = "auto"
    REQUIRED = "required"


class _Body(msgspec.Struct):
    """Base of every request body and part (unknown fields are ignored)."""


# OpenAI's rule for a function's name.
FunctionNameText = Annotated[
    str, msgspec.Meta(min_length=1, max_length=64, pattern="^[a-zA-Z0-9_-]+$")
]


# A caller's request id (vLLM's request_id, or an X-Request-Id header): it names the response
# and the request's log lines, so it is bounded and has no control characters (no forged lines).
MAX_REQUEST_ID_CHARS = 256
RequestIdText = Annotated[
    str,
    msgspec.Meta(min_length=1, max_length=MAX_REQUEST_ID_CHARS, pattern="^[^\x00-\x1f\x7f]*$"),
]


class FunctionDefinition(_Body, omit_defaults=True):
    name: FunctionNameText
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None


class Tool(_Body, omit_defaults=True):
    """{"type": "function", "function": {...}}; msgspec.to_builtins gives it back as sent."""

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: FunctionName


ToolChoice = ToolChoiceMode | NamedToolChoice


class FunctionCall(_Body):
    """A call an earlier assistant turn made; `arguments` is JSON text, as OpenAI sends it."""

    name: str
    arguments: str | None = None

    def __post_init__(self) -> None:
        self.decoded_arguments()  # a ValueError here is a 400 naming this call

    def decoded_arguments(self) -> Any:
        try:
            return msgspec.json.decode(self.arguments or "{}")
        except msgspec.DecodeError:
            raise ValueError(
                "'arguments' must be JSON text, e.g. '{\"city\": \"Paris\"}'"
            ) from None


class ToolCall(_Body):
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


class ContentPart(_Body):
    """A part of a message's content; a text model can serve only text parts."""

    type: str
    text: str | None = None

    def __post_init__(self) -> None:
        if self.type != "text":
            raise ValueError(f"only text content parts are supported, got type {show(self.type)}")


class Message(_Body):
    role: Role
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class StreamOptions(_Body):
    include_usage: bool | None = None
    continuous_usage_stats: bool | None = None  # vLLM's: usage in every chunk too


class StreamUsage(StrEnum):
    """Where a stream reports token usage (stream_options)."""

    NONE = "none"
    FINAL = "final"  # include_usage: a last chunk with the totals
    EVERY_CHUNK = "every_chunk"  # and continuous_usage_stats (vLLM's): each chunk's so far


class TextFormat(_Body, tag="text", tag_field="type"):
    """response_format {"type": "text"}: no constraint."""


class JSONObjectFormat(_Body, tag="json_object", tag_field="type"):
    """response_format {"type": "json_object"}: any JSON object."""


class JSONSchemaSpec(_Body):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class JSONSchemaFormat(_Body, tag="json_schema", tag_field="type"):
    json_schema: JSONSchemaSpec


ResponseFormat = TextFormat | JSONObjectFormat | JSONSchemaFormat


class StructuredOutputs(_Body, forbid_unknown_fields=True):
    """vLLM's `structured_outputs`: exactly one constraint (StructuredOutputsParams checks
    that); `backend` and `disable_any_whitespace` are accepted and ignored."""

    json: dict[str, Any] | str | None = None
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    backend: str | None = None
    disable_any_whitespace: bool | None = None


class GenerationRequest(_Body):
    """The fields both generation endpoints take."""

    model: str | None = None
    # Sampling (SamplingParams' names and checks).
    n: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: serve only the prompt's last tokens
    allowed_token_ids: list[int] | None = None  # vLLM's: sample only these ids
    bad_words: list[str] | None = None  # vLLM's: words never generated
    # Output constraints: at most one of these (server/structured_outputs.py).
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Delivery, scheduling and tenancy.
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    lane: Lane | None = None
    priority: int | None = None  # vLLM's; only its default 0 is accepted
    timeout: float | None = None
    user: str | None = None
    # vLLM's: the response's id is "cmpl-" or "chatcmpl-" and this (an X-Request-Id header wins)
    request_id: RequestIdText | None = None
    cache_salt: str | None = None  # vLLM's: prefix-cache blocks shared only with this salt
    return_tokens_as_token_ids: bool | None = None  # vLLM's: logprobs name "token_id:ID"
    return_token_ids: bool | None = None  # vLLM's: the prompt's and the output's token ids too
    # vLLM's: special tokens (a BOS) added to a text prompt; default true for completions,
    # false for chat (whose template holds them)
    add_special_tokens: bool | None = None
    echo: bool | None = None  # completions: the prompt first in text and logprobs
    prompt_logprobs: int | None = None  # vLLM's, completions: every prompt token's top-k
    logit_bias: dict[str, float] | None = None  # token id (a string, as JSON keys are) -> bias
    # Refused when set: jserve cannot honour them.
    suffix: str | None = None
    best_of: int | None = None
    functions: Any = None
    use_beam_search: bool | None = None  # vLLM's: the n best beams (jserve.engine.beam_search)
    length_penalty: float | None = None  # vLLM's: a beam's score is logprob / length ** this
    spaces_between_special_tokens: bool | None = None  # vLLM's: False joins special tokens
    # vLLM's extensions jserve does not honour: refused unless left at vLLM's default
    # (server/protocol.py:VLLM_UNHONOURED), never silently ignored.
    logits_processors: Any = None


class CompletionRequest(GenerationRequest, kw_only=True):
    """POST /v1/completions. `prompt` is a string, token ids, or a batch of exactly one."""

    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = None  # None: 16, OpenAI's default for completions
    logprobs: int | None = None
    tools: Any = None  # refused: tools are for chat


class ChatRequest(GenerationRequest, kw_only=True):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], msgspec.Meta(min_length=1)]
    max_tokens: int | None = None  # None: as much as the context window leaves
    max_completion_tokens: int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: Annotated[list[Tool], msgspec.Meta(min_length=1)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat template controls.
    add_generation_prompt: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # more variables for the template
    continue_final_message: bool | None = None  # go on with the final (assistant) message
    chat_template: str | None = None  # vLLM's: served with --trust-request-chat-template
    documents: list[dict[str, str]] | None = None  # vLLM's: for a RAG template (title, text)


class EncodingFormat(StrEnum):
    """How /v1/embeddings writes each vector: a list of floats, or base64 of float32 bytes."""

    FLOAT = "float"
    BASE64 = "base64"


class EmbeddingRequest(_Body):
    """POST /v1/embeddings. `input` is a string, a list of strings, token ids, or a list of
    token-id lists (one embedding each)."""

    input: str | list[str | int | list[int]]
    model: str | None = None
    encoding_format: EncodingFormat | None = None
    dimensions: int | None = None  # only the model's hidden size
    user: str | None = None
    truncate_prompt_tokens: int | None = None  # vLLM's: embed only each input's last tokens


class TokenizeRequest(_Body):
    """POST /tokenize (vLLM's): a `prompt`, or chat `messages` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool | None = None
    messages: Annotated[list[Message], msgspec.Meta(min_length=1)] | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


class DetokenizeRequest(_Body):
    """POST /detokenize (vLLM's)."""

    tokens: list[int]
    model: str | None = None
