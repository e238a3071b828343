"""Render Hugging Face chat templates (jinja2) exactly as transformers' `apply_chat_template`.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable
sandbox. The environment mirrors transformers': `trim_blocks` and `lstrip_blocks`, the
`loopcontrols` extension, a `tojson` that does not HTML-escape, `raise_exception`,
`strftime_now`, and a `{% generation %}` block (transformers uses it to mask assistant tokens;
here it renders its body unchanged).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template is missing, does not compile, or rejects the conversation."""


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: render the body as-is."""

    tags = {"generation"}  # noqa: RUF012 (jinja2's Extension API declares it this way)

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # jinja2's own tojson HTML-escapes (<, >, &, '), which would change the prompt.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_chat_template(template: str) -> jinja2.Template:
    """Compile once per distinct template string (compiling costs far more than rendering)."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationBlock, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(template)
    except jinja2.TemplateSyntaxError as err:
        raise ChatTemplateError(
            f"chat template does not compile: {err} (line {err.lineno})"
        ) from err


def render_chat_template(
    template: str,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
    **variables: Any,
) -> str:
    """The prompt text `template` makes of `messages`.

    Args:
        template: jinja2 source, as in `tokenizer_config.json` or GGUF `tokenizer.chat_template`.
        messages: dicts with at least "role" and "content"; keys whose value is None are dropped
            first, as transformers does (many templates print a literal "None" otherwise).
        add_generation_prompt: end with the header that starts the assistant's turn.
        tools: JSON-schema tool definitions, for templates that support them.
        **variables: more template variables, e.g. `bos_token`, `eos_token`.

    Raises:
        ChatTemplateError: empty conversation, a message that is not a mapping, a template that
            does not compile, or one that rejects the conversation (`raise_exception`).
    """
    if not messages:
        raise ChatTemplateError("cannot apply a chat template to an empty conversation")
    plain_messages = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(
                f"message {index} is a {type(message).__name__}, expected a dict with "
                "'role' and 'content'"
            )
        plain_messages.append({k: v for k, v in message.items() if v is not None})
    compiled = compile_chat_template(template)
    try:
        return compiled.render(
            messages=plain_messages,
            tools=None if tools is None else [dict(t) for t in tools],
            add_generation_prompt=add_generation_prompt,
            # transformers always defines `documents`; `documents is none` must hold here too.
            **{"documents": None, **variables},
        )
    except Exception as err:
        # Template code is arbitrary: whatever fails in it (raise_exception, a TypeError on a
        # missing field) is a problem of this template with this conversation, not of the caller.
        raise ChatTemplateError(f"chat template rejected the conversation: {err}") from err


def continued_final_message(rendered: str, messages: Sequence[Mapping[str, Any]]) -> str:
    """`rendered` (the conversation rendered without a generation prompt) cut right after the
    final message's content, so the model goes on with that message instead of starting a new
    one: a prefilled start of its answer (transformers' and vLLM's continue_final_message,
    whose cut this is, trailing spaces included where the template kept them).

    Raises:
        ChatTemplateError: the final message has no text, or the template did not write it.
    """
    final = messages[-1].get("content") if messages else None
    if not isinstance(final, str) or not final.strip():
        raise ChatTemplateError(
            "continue_final_message needs a final message with text to continue"
        )
    at = rendered.rfind(final.strip())
    if at < 0:
        raise ChatTemplateError(
            "continue_final_message: the chat template did not write the final message's "
            "content as given, so it cannot be continued"
        )
    kept = final.lstrip()
    if rendered[at : at + len(kept)] == kept:
        return rendered[: at + len(kept)]
    return rendered[: at + len(final.strip())]


_JINJA_CHARS = frozenset("{}\n")


def load_chat_template(value: str) -> str:
    """The template `--chat-template` names, as vLLM reads it: the contents of the file at
    `value`, else `value` itself when it looks like Jinja (has a brace or a newline); it must
    compile.

    Raises:
        ChatTemplateError: `value` is neither a readable file nor a template, or it does not
            compile.
    """
    try:
        with open(value, encoding="utf-8") as f:
            template = f.read()
    except OSError as err:
        if not _JINJA_CHARS & set(value):
            raise ChatTemplateError(
                f"--chat-template {value!r} looks like a file path, but it cannot be read "
                f"({err.strerror}); give a readable file or the Jinja template itself"
            ) from err
        template = value
    compile_chat_template(template)
    return template
