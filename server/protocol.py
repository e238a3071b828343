"""Turn decoded OpenAI completion and chat requests into a prompt plus SamplingParams.

The bodies' shapes and types are the Structs of server/protocol_types.py (decoded by
server/decoding.py); here are the checks that need more than one field or jserve's own rules,
each a 400 naming the field: the prompt's forms, fields jserve cannot honour (echo on chat,
suffix, best_of != n, functions, tools on completions), tools against
tool_choice, at most one output constraint (server/structured_outputs.py), and the value
ranges SamplingParams checks (jserve/sampling_params.py). An explicit null is the field's
default.

jserve's own fields: `lane` (default "interactive") picks the scheduling lane, and `timeout`
(seconds) sets the request's deadline (jserve.core.deadlines; a deadline the engine estimates
it cannot meet is refused at once with 429). The tenant a request is served for (fair share,
caps, metrics: jserve.core.tenants) is the `X-Tenant` header, else the OpenAI `user` field,
else "default" (`request_tenant`). vLLM's integer `priority` is accepted only as its default 0
(see `_refuse_priority`).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import msgspec

from jserve.config.regex_size import check_json_schema
from jserve.config.scheduler import Lane
from jserve.config.validation import FLOAT32_MAX, check_float, check_int, check_token_ids, show
from jserve.core.tenants import DEFAULT_TENANT, check_tenant_name
from jserve.sampling_params import (
    MAX_BIAS,
    MAX_LOGPROBS,
    SamplingParams,
    StructuredOutputsParams,
    truncate_prompt,
)
from jserve.server.api_errors import APIError
from jserve.server.engine_client import TokenizerLike
from jserve.server.protocol_types import (
    ChatRequest,
    CompletionRequest,
    GenerationRequest,
    Message,
    StreamOptions,
    StreamUsage,
    TokenizeRequest,
    ToolChoiceMode,
)
from jserve.server.structured_outputs import constraint_field, output_constraint
from jserve.server.tools import ToolRequest, ToolUse, calls_as_text, with_tool_prompt

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# Fields passed to SamplingParams under the same name when the request sets them.
_SAMPLING_FIELDS = (
    "n", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "min_tokens", "stop", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "include_stop_str_in_output", "truncate_prompt_tokens",
    "allowed_token_ids", "bad_words", "spaces_between_special_tokens",
)  # fmt: skip
_SAMPLING_PARAMS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


@dataclass(frozen=True)
class RequestPolicy:
    """What the server's settings decide for every request (server/settings.py): the most
    logprobs one may ask for, whether tool_choice "auto" is served, the sampling defaults
    of fields a request leaves out (--generation-config), and whether a request's own chat
    template is rendered (--trust-request-chat-template)."""

    max_logprobs: int = MAX_LOGPROBS
    auto_tool_choice: bool = True
    sampling_defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    trust_request_chat_template: bool = False


_DEFAULT_POLICY = RequestPolicy()


@dataclass
class ParsedRequest:
    prompt: str | list[int] | None  # None for chat, whose `messages` become the prompt
    messages: list[dict[str, str]] | None
    params: SamplingParams
    model: str | None
    stream: bool
    usage: StreamUsage
    lane: Lane
    timeout: float | None
    top_logprobs: int = 0  # chat: how many alternatives to list per token
    tools: ToolRequest | None = None  # chat: the tools it may call (server/tools.py)
    # The request's field for each SamplingParams name where they differ (for errors).
    fields: dict[str, str] = dataclasses.field(default_factory=dict)
    echo: bool = False  # completions: the prompt leads the text (and the logprobs)
    # chat: end with the assistant's header; more template variables (chat_template_kwargs)
    add_generation_prompt: bool = True
    template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False  # chat: the final message is continued, not closed
    documents: list[dict[str, str]] | None = None  # chat: vLLM's, for a RAG template
    chat_template: str | None = None  # chat: the request's own template (trusted requests)
    # vLLM's: the prompt's prefix-cache blocks are shared only with requests of this salt
    cache_salt: str | None = None
    tokens_as_ids: bool = False  # vLLM's return_tokens_as_token_ids: logprobs name token ids
    token_ids: bool = False  # vLLM's return_token_ids: the response carries token ids
    add_special_tokens: bool = True  # a text prompt's (vLLM's; chat's default is False)
    # vLLM's use_beam_search: `params.n` beams (jserve.engine.beam_search), each scored as
    # cumulative logprob / length ** length_penalty
    use_beam_search: bool = False
    length_penalty: float = 1.0


# vLLM's request extensions jserve does not honour, and the values that change nothing (vLLM's
# defaults): any other value is a 400 naming the field rather than an answer that ignored it.
VLLM_UNHONOURED: dict[str, tuple[Any, ...]] = {
    "logits_processors": ([],),
}
# Template variables a request's chat_template_kwargs may not set: the server sets them.
_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "documents", "bos_token", "eos_token"}
)


# What a beam search does not read (it ranks whole beams by log-probability, nothing else): set
# with use_beam_search to a value that would change an answer (not SamplingParams' default,
# nor one of _BEAM_HARMLESS), each is a 400 naming it rather than an answer that ignored it.
_NOT_WITH_BEAM_SEARCH = (
    "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
    "repetition_penalty", "min_tokens", "stop", "stop_token_ids", "allowed_token_ids",
    "bad_words", "skip_special_tokens", "response_format", "structured_outputs", "guided_json",
    "guided_regex", "guided_choice", "guided_grammar", "logprobs", "top_logprobs",
    "prompt_logprobs", "tools", "tool_choice", "logit_bias",
)  # fmt: skip
_BEAM_HARMLESS: dict[str, tuple[Any, ...]] = {"logprobs": (False,), "top_logprobs": (0,)}
_SAMPLING_DEFAULTS = SamplingParams()


def _same(value: Any, harmless: Any) -> bool:
    """Equal, and both or neither a bool (logprobs 0 asks for logprobs; false does not)."""
    return isinstance(value, bool) == isinstance(harmless, bool) and value == harmless


def _changes_nothing(name: str, value: Any) -> bool:
    """Whether a request field at `value` asks for nothing: absent, empty, SamplingParams'
    default (top_k -1 is its 0), or one of _BEAM_HARMLESS."""
    if value is None or value in ([], {}) or (name == "top_k" and value == -1):
        return True
    if any(_same(value, h) for h in _BEAM_HARMLESS.get(name, ())):
        return True
    default = getattr(_SAMPLING_DEFAULTS, name) if name in _SAMPLING_PARAMS else None
    return default is not None and _same(value, default)


def _beam_search(body: GenerationRequest) -> tuple[bool, float]:
    """(use_beam_search, length_penalty) of the request, refusing what a beam search would
    ignore, and a length_penalty without one."""
    penalty = 1.0 if body.length_penalty is None else body.length_penalty
    if not body.use_beam_search:
        if penalty != 1.0:
            raise APIError(
                400, "'length_penalty' applies only with use_beam_search", param="length_penalty"
            )
        return False, penalty
    for name in _NOT_WITH_BEAM_SEARCH:
        # (chat's and completions' own fields are absent from the other's body)
        if not _changes_nothing(name, getattr(body, name, None)):
            raise APIError(400, f"'{name}' does not apply with use_beam_search", param=name)
    return True, penalty


def _refuse_unsupported(body: GenerationRequest) -> None:
    for name, harmless in VLLM_UNHONOURED.items():
        value = getattr(body, name, None)  # chat's fields are absent from completions
        if value is not None and value not in harmless:
            raise APIError(
                400, f"'{name}' (a vLLM extension) is not supported; leave it out", param=name
            )
    if body.suffix:
        raise APIError(400, "'suffix' is not supported", param="suffix")
    if body.best_of is not None and body.best_of != (body.n or 1):
        raise APIError(400, "'best_of' is not supported unless it equals n", param="best_of")
    if body.functions is not None:
        raise APIError(
            400, "'functions' is deprecated and not supported; send 'tools'", param="functions"
        )


def _sampling_params(
    body: GenerationRequest,
    max_tokens: int | None,
    logprobs: int | None,
    constraint: StructuredOutputsParams | None,
    renamed: dict[str, str],
    defaults: Mapping[str, Any],
    prompt_logprobs: int | None = None,
) -> SamplingParams:
    """SamplingParams of the request: fields it leaves out (or null) take `defaults`, else
    SamplingParams' own, except max_tokens, whose None means "fill the context". A value out
    of range is a 400 naming the field; `renamed` maps a SamplingParams name to the field the
    request used."""
    given = {name: getattr(body, name) for name in _SAMPLING_FIELDS}
    given["logit_bias"] = _logit_bias(body.logit_bias)
    kwargs: dict[str, Any] = {**defaults, **{k: v for k, v in given.items() if v is not None}}
    kwargs.update(max_tokens=max_tokens, logprobs=logprobs, structured_outputs=constraint)
    kwargs.update(prompt_logprobs=prompt_logprobs)
    try:
        return SamplingParams(**kwargs)
    except ValueError as exc:
        # SamplingParams' messages start with the field's name ("stop_token_ids[0] must be").
        field = re.match(r"(\w+)(\[\d+\])?", str(exc))
        param = None
        if field is not None and field[1] in _SAMPLING_PARAMS:
            param = renamed.get(field[1], field[1]) + (field[2] or "")
        raise APIError(400, str(exc), param=param) from exc


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias as SamplingParams takes it: each key (a JSON string) as its token
    id, each bias clamped into [-100, 100] as vLLM clamps it; a key that is not an integer is
    a 400."""
    if bias is None:
        return None
    ids = {}
    for key, value in bias.items():
        if re.fullmatch(r"-?\d+", key.strip()) is None:
            raise APIError(
                400, f"logit_bias keys must be token ids (integers), got {show(key)}",
                param="logit_bias",
            )  # fmt: skip
        ids[int(key)] = min(MAX_BIAS, max(-MAX_BIAS, value))
    return ids


def _checked(check: Callable[..., Any], name: str, *args: Any, **kwargs: Any) -> Any:
    """A jserve.config.validation check whose ValueError becomes a 400 naming the field."""
    try:
        return check(name, *args, **kwargs)
    except ValueError as exc:
        raise APIError(400, str(exc), param=name) from exc


def adds_generation_prompt(body: ChatRequest | TokenizeRequest) -> bool:
    """Whether the rendered chat ends with the assistant's header: by default, and never when
    the final message is continued (asking for both is a 400, as in vLLM)."""
    if body.continue_final_message and body.add_generation_prompt:
        raise APIError(
            400,
            "continue_final_message and add_generation_prompt cannot both be true: one goes on "
            "with the final message, the other starts a new one",
            param="continue_final_message",
        )
    return body.add_generation_prompt is not False and not body.continue_final_message


def _cache_salt(body: GenerationRequest) -> str | None:
    if body.cache_salt == "":
        raise APIError(400, "'cache_salt' must be a non-empty string", param="cache_salt")
    return body.cache_salt


def _request_options(body: GenerationRequest) -> tuple[bool, StreamUsage, Lane, float | None]:
    stream = bool(body.stream)
    if body.stream_options is not None and not stream:
        raise APIError(
            400, "'stream_options' is only allowed with stream=true", param="stream_options"
        )
    _refuse_priority(body.priority)
    if body.timeout is not None:
        _checked(check_float, "timeout", body.timeout, 0.0, FLOAT32_MAX, lo_open=True)
    return stream, _stream_usage(body.stream_options), body.lane or Lane.INTERACTIVE, body.timeout


def _stream_usage(options: StreamOptions | None) -> StreamUsage:
    """vLLM's continuous_usage_stats implies include_usage (whose default vLLM takes as true
    once stream_options is sent); with include_usage false it is a 400, not ignored."""
    if options is None:
        return StreamUsage.NONE
    if options.continuous_usage_stats:
        if options.include_usage is False:
            raise APIError(
                400, "'continuous_usage_stats' needs 'include_usage' (leave it out, or true)",
                param="stream_options.continuous_usage_stats",
            )  # fmt: skip
        return StreamUsage.EVERY_CHUNK
    return StreamUsage.FINAL if options.include_usage else StreamUsage.NONE


def _refuse_priority(priority: int | None) -> None:
    """vLLM's `priority` is an integer for its priority scheduler; jserve has none, and its
    lanes are named, not numbered. As vLLM does without priority scheduling, accept the
    default 0 (clients that always send it keep working) and refuse anything else, naming
    `lane`, rather than guess a mapping from numbers to lanes."""
    if priority is None or priority == 0:
        return
    raise APIError(
        400,
        f"'priority' (vLLM's integer scheduling priority) is not supported, got {show(priority)}"
        f"; choose a lane with 'lane': one of {[lane.value for lane in Lane]}",
        param="priority",
    )


def _prompt(prompt: str | list[str | int | list[int]]) -> str | list[int]:
    # A batch of exactly one prompt is accepted as that prompt.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError(400, "'prompt' must not be empty", param="prompt")
        return prompt
    if prompt and all(isinstance(t, int) for t in prompt):
        return prompt  # type: ignore[return-value]  # checked against the vocabulary later
    if prompt and all(isinstance(p, str | list) for p in prompt):
        raise APIError(
            400,
            f"one prompt per request is supported, got {len(prompt)}; send them separately",
            param="prompt",
        )
    raise APIError(
        400, "'prompt' must be a non-empty string or a non-empty list of token ids", param="prompt"
    )


def _check_logprobs(name: str, value: int | None, policy: RequestPolicy) -> None:
    """A 400 naming `name` if it asks for more logprobs than --max-logprobs allows."""
    if value is not None and value > policy.max_logprobs:
        raise APIError(
            400,
            f"{name} must be at most {policy.max_logprobs} (the server's --max-logprobs), got "
            f"{show(value)}",
            param=name,
        )


def parse_completion(
    body: CompletionRequest, policy: RequestPolicy = _DEFAULT_POLICY
) -> ParsedRequest:
    _refuse_unsupported(body)
    if body.tools is not None:
        raise APIError(400, "'tools' is only supported on /v1/chat/completions", param="tools")
    prompt = _prompt(body.prompt)
    _check_logprobs("logprobs", body.logprobs, policy)
    _check_logprobs("prompt_logprobs", body.prompt_logprobs, policy)
    max_tokens = DEFAULT_COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    echo = bool(body.echo)
    prompt_logprobs = body.prompt_logprobs
    if echo and body.logprobs is not None:  # the prompt's tokens lead the logprobs (vLLM's)
        prompt_logprobs = max(prompt_logprobs or 0, body.logprobs)
    params = _sampling_params(
        body, max_tokens, body.logprobs, output_constraint(body), {}, policy.sampling_defaults,
        prompt_logprobs,
    )  # fmt: skip
    stream, usage, lane, timeout = _request_options(body)
    use_beam_search, length_penalty = _beam_search(body)
    return ParsedRequest(
        prompt, None, params, body.model, stream, usage, lane, timeout,
        fields=_constraint_fields(constraint_field(body)), echo=echo,
        cache_salt=_cache_salt(body), tokens_as_ids=bool(body.return_tokens_as_token_ids),
        token_ids=bool(body.return_token_ids),
        add_special_tokens=body.add_special_tokens is not False,
        use_beam_search=use_beam_search, length_penalty=length_penalty,
    )  # fmt: skip


def _constraint_fields(name: str | None) -> dict[str, str]:
    return {} if name is None else {"structured_outputs": name}


def chat_messages(messages: list[Message]) -> list[dict[str, str]]:
    """The messages as the chat template takes them: text content parts joined, earlier tool
    calls written as text (server/tools.py)."""
    rendered = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = "".join(part.text or "" for part in content)
        calls = [
            (call.function.name, call.function.decoded_arguments())
            for call in message.tool_calls or ()
        ]
        rendered.append(
            {"role": message.role.value, "content": calls_as_text(content or "", calls)}
        )
    return rendered


def _tool_request(body: ChatRequest, auto_allowed: bool) -> ToolRequest | None:
    """The request's tools and tool_choice; None when there are none (or tool_choice is
    "none"). A null tool_choice is the default: "auto" with tools, a 400 unless
    `auto_allowed` (--enable-auto-tool-choice), as in vLLM."""
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, ToolChoiceMode.NONE):
            raise APIError(400, "'tool_choice' needs 'tools'", param="tool_choice")
        return None
    names: list[str] = []
    for i, tool in enumerate(body.tools):
        if tool.function.name in names:
            raise APIError(
                400, f"function name '{tool.function.name}' is given twice in 'tools'",
                param=f"tools[{i}].function.name",
            )  # fmt: skip
        names.append(tool.function.name)
    tools = [msgspec.to_builtins(tool) for tool in body.tools]
    parallel = body.parallel_tool_calls is not False
    if choice is None or choice == ToolChoiceMode.AUTO:
        if not auto_allowed:
            raise APIError(
                400,
                'tool_choice "auto" (the default with tools) is off on this server '
                '(--no-enable-auto-tool-choice); send "required", "none" or a named function',
                param="tool_choice",
            )
        return ToolRequest(tools, ToolUse.AUTO, parallel=parallel)
    if choice == ToolChoiceMode.NONE:
        return None
    if choice == ToolChoiceMode.REQUIRED:
        return ToolRequest(tools, ToolUse.REQUIRED, parallel=parallel)
    named = choice.function.name  # type: ignore[union-attr]  # a NamedToolChoice
    if named not in names:
        raise APIError(
            400, f"'tool_choice' names {show(named)}, which is not in 'tools'",
            param="tool_choice.function.name",
        )  # fmt: skip
    return ToolRequest(tools, ToolUse.NAMED, named=named, parallel=parallel)


def render_chat(
    tokenizer: TokenizerLike,
    messages: list[dict[str, str]],
    add_generation_prompt: bool = True,
    tools: ToolRequest | None = None,
    template_kwargs: dict[str, Any] | None = None,
    continue_final_message: bool = False,
    documents: list[dict[str, str]] | None = None,
    chat_template: str | None = None,
) -> str:
    """The chat template applied to `messages`; a template that rejects them is a 400.

    Tools go through the template when it renders `tools`, else into the system message.
    `template_kwargs` (vLLM's chat_template_kwargs) are more variables for the template; one
    the server sets itself is a 400. With `continue_final_message` the text ends inside the
    final message (TokenizerLike.apply_chat_template). `documents` (vLLM's) are the template's
    `documents` variable: a RAG template lists them, another ignores them. `chat_template`
    (a trusted request's own) replaces the model's; then a failure to render names it.
    """
    extra: dict[str, Any] = dict(template_kwargs or {})
    if reserved := sorted(_RESERVED_TEMPLATE_VARIABLES & extra.keys()):
        raise APIError(
            400, f"chat_template_kwargs may not set {reserved}: the server sets them",
            param="chat_template_kwargs",
        )  # fmt: skip
    if documents is not None:
        extra["documents"] = documents
    if tools is not None:
        if "tools" in (chat_template or getattr(tokenizer, "chat_template", None) or ""):
            extra["tools"] = tools.tools
        else:
            messages = with_tool_prompt(messages, tools.tools)
    try:
        return tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=False,
            continue_final_message=continue_final_message, chat_template=chat_template, **extra,
        )  # fmt: skip
    except ValueError as exc:  # loaders' ChatTemplateError is a ValueError
        param = "messages" if chat_template is None else "chat_template"
        raise APIError(400, f"cannot format the conversation: {exc}", param=param) from exc


UNTRUSTED_TEMPLATE = (
    "Chat template is passed with request, but --trust-request-chat-template is not set. "
    "Refused request with untrusted chat template."
)  # vLLM's words


def _request_chat_template(
    body: ChatRequest, policy: RequestPolicy
) -> tuple[str | None, dict[str, Any] | None]:
    """(the request's own chat template, the other chat_template_kwargs): vLLM's
    `chat_template`, or a `chat_template` among the kwargs (the field wins), refused as vLLM
    refuses it unless the server trusts requests' templates."""
    kwargs = body.chat_template_kwargs
    given = kwargs.get("chat_template") if kwargs else None
    param = "chat_template_kwargs" if body.chat_template is None else "chat_template"
    template = body.chat_template if body.chat_template is not None else given
    if kwargs and "chat_template" in kwargs:
        kwargs = {k: v for k, v in kwargs.items() if k != "chat_template"}
    if template is None:
        return None, kwargs
    if not policy.trust_request_chat_template:
        raise APIError(400, UNTRUSTED_TEMPLATE, param=param)
    if not isinstance(template, str) or not template.strip():
        raise APIError(400, f"{param}'s chat_template must be a non-empty string", param=param)
    return template, kwargs


def _chat_logprobs(body: ChatRequest, policy: RequestPolicy) -> tuple[int | None, int]:
    """(SamplingParams.logprobs, top_logprobs) of a chat request."""
    top_logprobs = body.top_logprobs
    if top_logprobs is not None and not body.logprobs:
        raise APIError(400, "'top_logprobs' requires logprobs=true", param="top_logprobs")
    if top_logprobs is not None:
        _checked(check_int, "top_logprobs", top_logprobs, 0, MAX_LOGPROBS)
        _check_logprobs("top_logprobs", top_logprobs, policy)
    return ((top_logprobs or 0) if body.logprobs else None), top_logprobs or 0


def _forced_constraint(tools: ToolRequest | None) -> StructuredOutputsParams | None:
    """The grammar a "required" or named tool_choice imposes (it embeds the tools' parameters
    schemas); a 400 naming the tool whose schema holds a regex too large to unroll."""
    if tools is None or tools.choice == ToolUse.AUTO:
        return None
    for i, tool in enumerate(tools.tools):
        if tools.named not in (None, tool["function"]["name"]):
            continue  # not in the grammar
        field = f"tools[{i}].function.parameters"
        try:
            check_json_schema(tool["function"].get("parameters") or {})
        except ValueError as exc:
            raise APIError(400, f"'{field}': {exc}", param=field) from exc
    return tools.constraint()


def parse_chat(body: ChatRequest, policy: RequestPolicy = _DEFAULT_POLICY) -> ParsedRequest:
    """Parse a chat request; encode_prompt renders and tokenizes its messages."""
    _refuse_unsupported(body)
    for name in ("echo", "prompt_logprobs"):
        if getattr(body, name) is not None and getattr(body, name) is not False:
            raise APIError(400, f"'{name}' is supported on /v1/completions only", param=name)
    messages = chat_messages(body.messages)
    # None (OpenAI's default for chat): as much as the context window leaves; the engine
    # resolves it per prompt.
    max_tokens, renamed = body.max_tokens, {}
    if body.max_completion_tokens is not None:
        max_tokens, renamed = body.max_completion_tokens, {"max_tokens": "max_completion_tokens"}
    logprobs, top_logprobs = _chat_logprobs(body, policy)
    tools = _tool_request(body, policy.auto_tool_choice)
    constraint = output_constraint(body)
    fields = {**renamed, **_constraint_fields(constraint_field(body))}
    forced = _forced_constraint(tools)
    if forced is not None:
        if constraint is not None:
            raise APIError(
                400,
                "tool_choice 'required' or a named function constrains the output itself; "
                "drop response_format / structured_outputs",
                param="tool_choice",
            )
        constraint, fields["structured_outputs"] = forced, "tools"
    params = _sampling_params(
        body, max_tokens, logprobs, constraint, renamed, policy.sampling_defaults
    )
    stream, usage, lane, timeout = _request_options(body)
    use_beam_search, length_penalty = _beam_search(body)
    template, template_kwargs = _request_chat_template(body, policy)
    return ParsedRequest(
        None, messages, params, body.model, stream, usage, lane, timeout, top_logprobs,
        tools, fields, add_generation_prompt=adds_generation_prompt(body),
        continue_final_message=bool(body.continue_final_message), chat_template=template,
        template_kwargs=template_kwargs, cache_salt=_cache_salt(body),
        tokens_as_ids=bool(body.return_tokens_as_token_ids), token_ids=bool(body.return_token_ids),
        add_special_tokens=bool(body.add_special_tokens), use_beam_search=use_beam_search,
        length_penalty=length_penalty, documents=body.documents,
    )  # fmt: skip


def encode_prompt(
    tokenizer: TokenizerLike, parsed: ParsedRequest, vocab_size: int, max_model_len: int
) -> list[int]:
    """The request's prompt token ids, every id (stop ids too) checked against the vocabulary,
    cut to the last `truncate_prompt_tokens` (jserve.sampling_params.truncate_prompt).

    Slow for long prompts (megabytes of text): the server runs it in a worker
    thread, never on the event loop. Chat messages are rendered with the chat template; a
    text, rendered or sent, takes special tokens as `add_special_tokens` says (vLLM's
    defaults: a completion's does, a chat's does not, the template holding them).
    """
    if parsed.messages is not None:
        text = render_chat(
            tokenizer, parsed.messages, parsed.add_generation_prompt, parsed.tools,
            parsed.template_kwargs, parsed.continue_final_message, parsed.documents,
            parsed.chat_template,
        )  # fmt: skip
        ids = tokenizer.encode(text, add_special_tokens=parsed.add_special_tokens)
    elif isinstance(parsed.prompt, str):
        ids = tokenizer.encode(parsed.prompt, add_special_tokens=parsed.add_special_tokens)
    else:
        ids = _checked(check_token_ids, "prompt", parsed.prompt or [], vocab_size)
    _checked(check_token_ids, "stop_token_ids", parsed.params.stop_token_ids, vocab_size)
    try:
        return truncate_prompt(ids, parsed.params.truncate_prompt_tokens, max_model_len)
    except ValueError as exc:
        raise APIError(400, str(exc), param="truncate_prompt_tokens") from exc


def request_tenant(header: str | None, user: str | None) -> str:
    """The tenant of a request: the `X-Tenant` header (a gateway's word), else the OpenAI
    `user` field, else the default tenant; a 400 names a malformed one."""
    if header is not None:
        name, param = header, "X-Tenant"
    elif user is not None:
        name, param = user, "user"
    else:
        return DEFAULT_TENANT
    try:
        return check_tenant_name(name)
    except ValueError as exc:
        raise APIError(400, f"'{param}': {exc}", param=param) from exc
