"""Parse OpenAI completion and chat requests into a prompt plus SamplingParams.

Every check raises APIError(400) naming the field, so a client learns what to fix. Unknown
fields are ignored (as OpenAI-compatible servers do); fields jserve cannot honour (echo, suffix,
logit_bias, best_of != n, tools on completions) are refused rather than ignored. Output
constraints (response_format, structured_outputs, guided_*) are parsed by
server/structured_outputs.py, tools and tool_choice by server/tools.py.

jserve's own fields: `lane` (one of jserve.config.scheduler.LANES, default "interactive") picks the
scheduling lane, and `timeout` (seconds) sets the request's deadline (jserve.core.deadlines;
a deadline the engine estimates it cannot meet is refused at once with 429). The tenant a
request is served for (fair share, caps, metrics: jserve.core.tenants) is the `X-Tenant`
header, else the OpenAI `user` field, else "default" (`request_tenant`).
vLLM's integer `priority` is accepted only as its default 0 (see `_refuse_priority`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from jserve.config.scheduler import LANES
from jserve.config.validation import FLOAT32_MAX, check_float, check_int, check_token_ids
from jserve.core.tenants import DEFAULT_TENANT, check_tenant_name
from jserve.sampling_params import MAX_LOGPROBS, SamplingParams
from jserve.server.api_errors import APIError
from jserve.server.engine_client import TokenizerLike
from jserve.server.structured_outputs import parse_structured_outputs
from jserve.server.tools import ToolRequest, calls_as_text, parse_tools, with_tool_prompt

INT = "an integer"
NUMBER = "a number"
STR = "a string"
BOOL = "a boolean"
LIST = "a list"
OBJECT = "an object"

# Fields passed to SamplingParams under the same name.
_NUMBER_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_INT_FIELDS = ("n", "top_k", "min_tokens", "seed")


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None  # None for chat, whose `messages` become the prompt
    messages: list[dict[str, Any]] | None
    params: SamplingParams
    model: str | None
    stream: bool
    include_usage: bool
    lane: str
    timeout: float | None
    top_logprobs: int = 0  # chat: how many alternatives to list per token
    tools: ToolRequest | None = None  # chat: the tools it may call (server/tools.py)


def _is_kind(value: Any, kind: str) -> bool:
    if kind == INT:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == NUMBER:
        return isinstance(value, int | float) and not isinstance(value, bool)
    return isinstance(value, {STR: str, BOOL: bool, LIST: list, OBJECT: dict}[kind])


def typed_field(body: dict, name: str, kind: str, default: Any = None) -> Any:
    """body[name] checked to be of `kind`; None or absent gives `default`."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_kind(value, kind):
        raise APIError(
            400, f"'{name}' must be {kind}, got {type(value).__name__} {value!r}", param=name
        )
    return value


def _int_list(body: dict, name: str) -> list[int] | None:
    value = typed_field(body, name, LIST)
    if value is not None and not all(_is_kind(v, INT) for v in value):
        raise APIError(400, f"'{name}' must be a list of integers", param=name)
    return value


def _stop(body: dict) -> list[str] | None:
    stop = body.get("stop")
    if stop is None or isinstance(stop, str):
        return None if stop is None else [stop]
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        return stop
    raise APIError(400, "'stop' must be a string or a list of strings", param="stop")


def _refuse_unsupported(body: dict) -> None:
    if body.get("echo"):
        raise APIError(400, "'echo' is not supported; send echo=false", param="echo")
    if body.get("suffix"):
        raise APIError(400, "'suffix' is not supported", param="suffix")
    if body.get("logit_bias"):
        raise APIError(400, "'logit_bias' is not supported", param="logit_bias")
    best_of = body.get("best_of")
    if best_of is not None and best_of != body.get("n", 1):
        raise APIError(400, "'best_of' is not supported unless it equals n", param="best_of")


def _common(body: dict, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
    """SamplingParams keyword arguments of both endpoints: absent fields are left out (so the
    defaults apply), except max_tokens, whose None means "fill the context"."""
    kwargs: dict[str, Any] = {"logprobs": logprobs}
    for name in _NUMBER_FIELDS:
        kwargs[name] = typed_field(body, name, NUMBER)
    for name in _INT_FIELDS:
        kwargs[name] = typed_field(body, name, INT)
    kwargs["ignore_eos"] = typed_field(body, "ignore_eos", BOOL)
    kwargs["skip_special_tokens"] = typed_field(body, "skip_special_tokens", BOOL)
    kwargs["stop"] = _stop(body)
    kwargs["stop_token_ids"] = _int_list(body, "stop_token_ids")
    kwargs["structured_outputs"] = parse_structured_outputs(body)
    present = {k: v for k, v in kwargs.items() if v is not None}
    return {**present, "max_tokens": max_tokens}


def _sampling_params(kwargs: dict[str, Any]) -> SamplingParams:
    try:
        return SamplingParams(**kwargs)
    except (ValueError, TypeError) as exc:
        raise APIError(400, str(exc)) from exc


def _checked(check: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """A jserve.config.validation check whose ValueError becomes a 400 naming the field."""
    try:
        return check(name, *args, **kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=name.split("[")[0]) from exc


def _request_options(body: dict) -> tuple[bool, bool, str, float | None]:
    stream = typed_field(body, "stream", BOOL, False)
    options = typed_field(body, "stream_options", OBJECT)
    if options is not None and not stream:
        raise APIError(
            400, "'stream_options' is only allowed with stream=true", param="stream_options"
        )
    include_usage = bool(options and typed_field(options, "include_usage", BOOL, False))
    lane = typed_field(body, "lane", STR, "interactive")
    if lane not in LANES:
        raise APIError(400, f"'lane' must be one of {list(LANES)}, got {lane!r}", param="lane")
    _refuse_priority(body)
    timeout = typed_field(body, "timeout", NUMBER)
    if timeout is not None:
        _checked(check_float, "timeout", timeout, 0.0, FLOAT32_MAX, lo_open=True)
    return stream, include_usage, lane, timeout


def _refuse_priority(body: dict) -> None:
    """vLLM's `priority` is an integer for its priority scheduler; jserve has none, and its
    lanes are named, not numbered. As vLLM does without priority scheduling, accept the
    default 0 (clients that always send it keep working) and refuse anything else, naming
    `lane`, rather than guess a mapping from numbers to lanes."""
    priority = body.get("priority")
    if priority is None or (_is_kind(priority, INT) and priority == 0):
        return
    raise APIError(
        400,
        f"'priority' (vLLM's integer scheduling priority) is not supported, got {priority!r}; "
        f"choose a lane with 'lane': one of {list(LANES)}",
        param="priority",
    )


def _prompt(body: dict) -> str | list[int]:
    prompt = body.get("prompt")
    if prompt is None:
        raise APIError(400, "'prompt' is required", param="prompt")
    # A batch of exactly one prompt is accepted as that prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(_is_kind(t, INT) for t in prompt):
        return prompt  # checked against the vocabulary by encode_prompt
    if isinstance(prompt, list) and prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError(
            400,
            f"one prompt per request is supported, got {len(prompt)}; send them separately",
            param="prompt",
        )
    raise APIError(
        400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def parse_completion(body: dict) -> ParsedRequest:
    _refuse_unsupported(body)
    for name in ("tools", "functions"):
        if body.get(name) is not None:
            raise APIError(400, f"'{name}' is only supported on /v1/chat/completions", param=name)
    prompt = _prompt(body)
    max_tokens = typed_field(body, "max_tokens", INT, 16)
    logprobs = typed_field(body, "logprobs", INT)
    params = _sampling_params(_common(body, max_tokens, logprobs))
    stream, include_usage, lane, timeout = _request_options(body)
    model = typed_field(body, "model", STR)
    return ParsedRequest(prompt, None, params, model, stream, include_usage, lane, timeout)


def parse_messages(body: dict) -> list[dict[str, Any]]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty list", param="messages")
    cleaned = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise APIError(400, f"messages[{i}] must be an object with a 'role'", param="messages")
        content = message.get("content")
        if isinstance(content, list):
            # Content parts: only text parts can be served by a text model.
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise APIError(
                    400, f"messages[{i}]: only text content parts are supported", param="messages"
                )
            content = "".join(str(p.get("text", "")) for p in content)
        elif content is not None and not isinstance(content, str):
            raise APIError(
                400, f"messages[{i}].content must be a string or a list of parts", param="messages"
            )
        content = calls_as_text(content or "", message.get("tool_calls"))
        cleaned.append({"role": message["role"], "content": content})
    return cleaned


def render_chat(
    tokenizer: TokenizerLike,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
) -> str:
    """The chat template applied to `messages`; a template that rejects them is a 400.

    Tools go through the template when it renders `tools`, else into the system message.
    """
    extra: dict[str, Any] = {}
    if tools is not None:
        if "tools" in (getattr(tokenizer, "chat_template", None) or ""):
            extra["tools"] = tools.tools
        else:
            messages = with_tool_prompt(messages, tools.tools)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False, **extra
        )
    except ValueError as exc:  # loaders' ChatTemplateError is a ValueError
        raise APIError(400, f"cannot format the conversation: {exc}", param="messages") from exc


def parse_chat(body: dict) -> ParsedRequest:
    """Parse a chat request; encode_prompt renders and tokenizes its messages."""
    _refuse_unsupported(body)
    messages = parse_messages(body)
    max_tokens = typed_field(body, "max_completion_tokens", INT)
    if max_tokens is None:
        max_tokens = typed_field(body, "max_tokens", INT)
    # None (OpenAI's default for chat): as much as the context window leaves; the engine
    # resolves it per prompt.
    want_logprobs = typed_field(body, "logprobs", BOOL, False)
    top_logprobs = typed_field(body, "top_logprobs", INT)
    if top_logprobs is not None and not want_logprobs:
        raise APIError(400, "'top_logprobs' requires logprobs=true", param="top_logprobs")
    if top_logprobs is not None:
        _checked(check_int, "top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
    logprobs = (top_logprobs or 0) if want_logprobs else None
    kwargs = _common(body, max_tokens, logprobs)
    tools = parse_tools(body)
    forced = tools.constraint() if tools is not None else None
    if forced is not None:
        if kwargs.get("structured_outputs") is not None:
            raise APIError(
                400,
                "tool_choice 'required' or a named function constrains the output itself; "
                "drop response_format / structured_outputs",
                param="tool_choice",
            )
        kwargs["structured_outputs"] = forced
    params = _sampling_params(kwargs)
    stream, include_usage, lane, timeout = _request_options(body)
    model = typed_field(body, "model", STR)
    return ParsedRequest(
        None, messages, params, model, stream, include_usage, lane, timeout, top_logprobs or 0,
        tools,
    )  # fmt: skip


def encode_prompt(tokenizer: TokenizerLike, parsed: ParsedRequest, vocab_size: int) -> list[int]:
    """The request's prompt token ids, every id (stop ids too) checked against the vocabulary.

    Slow for long prompts (seconds for megabytes of text): the server runs it in a worker
    thread, never on the event loop. Chat messages are rendered with the chat template and
    tokenized without adding special tokens again (the template holds them).
    """
    if parsed.messages is not None:
        text = render_chat(tokenizer, parsed.messages, tools=parsed.tools)
        ids = tokenizer.encode(text, add_special_tokens=False)
    elif isinstance(parsed.prompt, str):
        ids = tokenizer.encode(parsed.prompt)
    else:
        ids = _checked(check_token_ids, "prompt", parsed.prompt or [], vocab_size)
    _checked(check_token_ids, "stop_token_ids", parsed.params.stop_token_ids, vocab_size)
    return ids


def request_tenant(header: str | None, body: dict) -> str:
    """The tenant of a request: the `X-Tenant` header (a gateway's word), else the OpenAI
    `user` field, else the default tenant; a 400 names a malformed one."""
    if header is not None:
        name, param = header, "X-Tenant"
    else:
        user = typed_field(body, "user", STR)
        if user is None:
            return DEFAULT_TENANT
        name, param = user, "user"
    try:
        return check_tenant_name(name)
    except ValueError as exc:
        raise APIError(400, f"'{param}': {exc}", param=param) from exc
