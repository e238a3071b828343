"""Build OpenAI response objects (and streaming chunks) from engine outputs.

Engine outputs are cumulative; a `ChoiceCursor` remembers how much of one choice was already
sent so each chunk carries only the new text, tokens and logprobs. A chat request with tools
turns the output's call blocks into `tool_calls` (server/tools.py): streamed content stops
where a block may start, the calls come in the choice's last chunk, and no call markup is
ever content, whether the output finished or was cut. finish_reason is "length" for a cut
output (with the calls completed before the cut), else "tool_calls" when calls were made
("stop" for a named function).

Completions with `echo` lead each choice's text with the prompt's and, with `logprobs`, its
logprobs arrays with the prompt's tokens (the first one's logprob null), as OpenAI's legacy
completions did; a stream sends them in the choice's first chunk. vLLM's `prompt_logprobs`
come as each choice's `prompt_logprobs` list (null for the first token; token id -> logprob,
rank, decoded_token), in the first chunk of a stream.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from jserve.outputs import CompletionOutput, FinishReason, Logprob, RequestOutput
from jserve.server.engine_client import TokenizerLike
from jserve.server.tools import ToolRequest, split_tool_calls, streamable_content_end


def usage(output: RequestOutput) -> dict[str, int]:
    return _usage(len(output.prompt_token_ids), sum(len(c.token_ids) for c in output.outputs))


def choice_usage(output: RequestOutput, choice: CompletionOutput) -> dict[str, int]:
    """The usage a choice's chunk reports with vLLM's continuous_usage_stats: the prompt and
    that choice's tokens so far."""
    return _usage(len(output.prompt_token_ids), len(choice.token_ids))


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


# How logprobs name a token: (token id, its Logprob if scored) -> the name.
TokenNamer = Callable[[int, Logprob | None], str]


def token_namer(tokenizer: TokenizerLike, as_ids: bool = False) -> TokenNamer:
    """Names for logprobs' tokens: each token's text, or with `as_ids` (vLLM's
    return_tokens_as_token_ids) "token_id:ID", which names a token whose text alone is not
    valid UTF-8 or is shared with another token."""

    def text(token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return tokenizer.decode([token_id], skip_special_tokens=False)

    return (lambda token_id, _: f"token_id:{token_id}") if as_ids else text


def _ranked(name: TokenNamer, alternatives: dict[int, Logprob]) -> list[tuple[str, float]]:
    ranked = sorted(alternatives.items(), key=lambda item: -item[1].logprob)
    return [(name(tid, lp), lp.logprob) for tid, lp in ranked]


@dataclass
class ChoiceCursor:
    """What has been sent of one choice so far."""

    num_chars: int = 0
    num_tokens: int = 0
    text_offset: int = 0  # legacy completions logprobs: characters of token text sent so far
    finished: bool = False
    started: bool = False  # its first chunk (the echo, prompt logprobs) was sent


def completion_logprobs(
    name: TokenNamer, out: CompletionOutput, cursor: ChoiceCursor, end: int
) -> dict[str, list] | None:
    """Legacy completions logprobs for tokens [cursor.num_tokens, end); advances text_offset."""
    if out.logprobs is None:
        return None
    result: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for i in range(cursor.num_tokens, end):
        token_id, alternatives = out.token_ids[i], out.logprobs[i]
        token = name(token_id, alternatives[token_id])
        result["tokens"].append(token)
        result["token_logprobs"].append(alternatives[token_id].logprob)
        result["top_logprobs"].append(dict(_ranked(name, alternatives)))
        result["text_offset"].append(cursor.text_offset)
        cursor.text_offset += len(token)
    return result


PromptLogprobs = Sequence[dict[int, Logprob] | None]


def prompt_logprobs_json(scored: PromptLogprobs) -> list[dict[int, dict] | None]:
    """vLLM's `prompt_logprobs` of a choice: per prompt token None (the first) or token id
    -> {logprob, rank, decoded_token}."""
    return [
        None
        if entry is None
        else {
            tid: {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for tid, lp in entry.items()
        }
        for entry in scored
    ]


def echo_logprobs(
    name: TokenNamer,
    prompt_ids: Sequence[int],
    scored: PromptLogprobs,
    cursor: ChoiceCursor,
) -> dict[str, list]:
    """Legacy completions logprobs of the prompt's tokens (the first's logprob and
    alternatives null); advances text_offset."""
    result: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for token_id, entry in zip(prompt_ids, scored, strict=True):
        if entry is None:
            token = name(token_id, None)
            result["token_logprobs"].append(None)
            result["top_logprobs"].append(None)
        else:
            token = name(token_id, entry[token_id])
            result["token_logprobs"].append(entry[token_id].logprob)
            result["top_logprobs"].append(dict(_ranked(name, entry)))
        result["tokens"].append(token)
        result["text_offset"].append(cursor.text_offset)
        cursor.text_offset += len(token)
    return result


def chat_logprobs(
    name: TokenNamer, out: CompletionOutput, start: int, end: int, top_n: int
) -> dict[str, list] | None:
    """Chat logprobs ({"content": [...]}) for tokens [start, end)."""
    if out.logprobs is None:
        return None

    def entry(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    content = []
    for i in range(start, end):
        token_id, alternatives = out.token_ids[i], out.logprobs[i]
        sampled = alternatives[token_id]
        item = entry(name(token_id, sampled), sampled.logprob)
        item["top_logprobs"] = [entry(t, lp) for t, lp in _ranked(name, alternatives)][:top_n]
        content.append(item)
    return {"content": content}


def _joined(first: dict | None, then: dict | None) -> dict | None:
    """Two runs of legacy logprobs arrays, one after the other."""
    if first is None or then is None:
        return then if first is None else first
    return {key: first[key] + then[key] for key in first}


class Endpoint(StrEnum):
    """The two generation endpoints a response is shaped for."""

    COMPLETION = "completion"  # /v1/completions
    CHAT = "chat"  # /v1/chat/completions


class ResponseBuilder:
    """Shapes one request's responses for either endpoint."""

    def __init__(
        self,
        kind: Endpoint,
        request_id: str,
        model: str,
        tokenizer: TokenizerLike,
        top_logprobs: int = 0,
        tools: ToolRequest | None = None,
        echo: str | None = None,
        tokens_as_ids: bool = False,
        token_ids: bool = False,
    ) -> None:
        """`echo`: the prompt's text, which leads each choice's (completions' `echo`);
        `tokens_as_ids`: logprobs name tokens "token_id:ID" (token_namer); `token_ids`
        (vLLM's return_token_ids): the response carries the prompt's and the output's token
        ids where vLLM puts them: `token_ids` in each choice (a stream's chunks: their new
        ones), `prompt_token_ids` in a completion's choice or at a chat response's top level
        (a stream's: in each choice's first chunk)."""
        self.kind = kind
        self.echo = echo
        self.request_id = request_id
        self.model = model
        self.token_name = token_namer(tokenizer, tokens_as_ids)
        self.top_logprobs = top_logprobs
        self.token_ids = token_ids
        self.tools = tools if kind == Endpoint.CHAT else None
        self.created = int(time.time())

    def _envelope(self, object_name: str, choices: list[dict]) -> dict[str, Any]:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def _logprobs(self, out: CompletionOutput, cursor: ChoiceCursor, end: int) -> dict | None:
        if self.kind == Endpoint.COMPLETION:
            return completion_logprobs(self.token_name, out, cursor, end)
        return chat_logprobs(self.token_name, out, cursor.num_tokens, end, self.top_logprobs)

    def _lead(
        self, request: RequestOutput, out: CompletionOutput, cursor: ChoiceCursor
    ) -> tuple[str, dict | None, dict[str, Any]]:
        """What leads a choice's first chunk: the echoed prompt's text and logprobs, and the
        choice's extra fields (`prompt_logprobs`)."""
        scored = request.prompt_logprobs
        fields = {} if scored is None else {"prompt_logprobs": prompt_logprobs_json(scored)}
        if self.echo is None:
            return "", None, fields
        logprobs = None
        if out.logprobs is not None and scored is not None:
            logprobs = echo_logprobs(self.token_name, request.prompt_token_ids, scored, cursor)
        return self.echo, logprobs, fields

    def _content(self, out: CompletionOutput) -> tuple[int, list[dict[str, Any]]]:
        """(end, calls): `out.text[:end]` is the content to show so far, `calls` the tool
        calls of a finished output."""
        if self.tools is None:
            return len(out.text), []
        if not out.finished:
            return streamable_content_end(out.text), []
        content, calls = split_tool_calls(out.text, cut=out.finish_reason != FinishReason.STOP)
        return len(content), calls if self.tools.parallel else calls[:1]

    def _finish_reason(self, out: CompletionOutput, calls: list) -> str | None:
        if calls and out.finish_reason == FinishReason.STOP and self.tools is not None:
            return self.tools.finish_reason
        return out.finish_reason

    def full_response(self, final: RequestOutput) -> dict[str, Any]:
        choices = []
        for out in final.outputs:
            cursor = ChoiceCursor()
            lead, lead_logprobs, fields = self._lead(final, out, cursor)
            logprobs = _joined(lead_logprobs, self._logprobs(out, cursor, len(out.token_ids)))
            choice: dict[str, Any] = {"index": out.index}
            end, calls = self._content(out)
            if self.kind == Endpoint.COMPLETION:
                choice["text"] = lead + out.text
            else:
                choice["message"] = {"role": "assistant", "content": out.text[:end]}
                if calls:
                    choice["message"].update(content=out.text[:end] or None, tool_calls=calls)
            choice.update(
                logprobs=logprobs,
                finish_reason=self._finish_reason(out, calls),
                stop_reason=out.stop_reason,
                **fields,
            )
            if self.token_ids:
                choice["token_ids"] = list(out.token_ids)
            choices.append(choice)
        name = "text_completion" if self.kind == Endpoint.COMPLETION else "chat.completion"
        response = self._envelope(name, choices)
        self._prompt_token_ids(response, final)
        response["usage"] = usage(final)
        return response

    def _prompt_token_ids(self, response: dict[str, Any], request: RequestOutput) -> None:
        """With `token_ids`, the prompt's ids where vLLM puts them: in a completion's choices,
        at a chat response's top level."""
        if not self.token_ids:
            return
        ids = list(request.prompt_token_ids)
        if self.kind == Endpoint.COMPLETION:
            for choice in response["choices"]:
                choice["prompt_token_ids"] = ids
        else:
            response["prompt_token_ids"] = ids

    def delta_chunk(
        self, out: CompletionOutput, cursor: ChoiceCursor, request: RequestOutput | None = None
    ) -> dict[str, Any] | None:
        """The chunk carrying what is new in `out` since `cursor`, or None if nothing is.
        `request` (the output `out` is a choice of) gives the first chunk its echo and prompt
        logprobs."""
        if cursor.finished:
            return None
        text_end, calls = self._content(out)
        text = out.text[cursor.num_chars : text_end]
        end = len(out.token_ids)
        if not text and end == cursor.num_tokens and not out.finished:
            return None
        lead, lead_logprobs, fields = "", None, {}
        first = not cursor.started and request is not None
        if first:
            lead, lead_logprobs, fields = self._lead(request, out, cursor)
        cursor.started = True
        logprobs = self._logprobs(out, cursor, end) if end > cursor.num_tokens else None
        logprobs = _joined(lead_logprobs, logprobs)
        choice: dict[str, Any] = {"index": out.index, **fields}
        if self.kind == Endpoint.COMPLETION:
            choice["text"] = lead + text
        else:
            delta: dict[str, Any] = {"role": "assistant"} if cursor.num_tokens == 0 else {}
            if text or not out.finished:
                delta["content"] = text
            if calls:
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(calls)]
            choice["delta"] = delta
        choice.update(logprobs=logprobs, finish_reason=self._finish_reason(out, calls))
        if out.finished:
            choice["stop_reason"] = out.stop_reason
        if self.token_ids:
            choice["token_ids"] = list(out.token_ids[cursor.num_tokens : end])
        cursor.num_chars, cursor.num_tokens = text_end, end
        cursor.finished = out.finished
        name = "text_completion" if self.kind == Endpoint.COMPLETION else "chat.completion.chunk"
        chunk = self._envelope(name, [choice])
        if first:
            self._prompt_token_ids(chunk, request)
        return chunk

    def usage_chunk(self, final: RequestOutput) -> dict[str, Any]:
        name = "text_completion" if self.kind == Endpoint.COMPLETION else "chat.completion.chunk"
        chunk = self._envelope(name, [])
        chunk["usage"] = usage(final)
        return chunk
