"""Responses API objects and stream events, assembled from the chat path's output.

/v1/responses generates through the chat path (server/responses_api.py), so what the model
said arrives as chat content and tool calls (server/openai_format.py's ResponseBuilder: call
markup already split off, content streamed only up to where a call may start). A
`ResponseAssembler` turns that into the Responses API's output items and typed events, in the
order OpenAI sends them (openai-python's types under openai/types/responses/ are the shapes):

    response.created, response.in_progress,
    per item: response.output_item.added,
      a message: response.content_part.added, response.output_text.delta..., then
        response.output_text.done, response.content_part.done,
      a function call: response.function_call_arguments.delta, ...arguments.done,
    response.output_item.done,
    response.completed (or response.incomplete / response.failed),

each with its `sequence_number`. The message item opens at the first text; function calls
come after it, when the output has finished (the chat path knows them only then); an output
with neither gets an empty message. A non-streamed response is assembled the same way and
its events dropped, so both give the same object.

Status: "completed", or "incomplete" with incomplete_details.reason "max_output_tokens" when
the output was cut at its length limit; jserve's own reasons "timeout" (the request's
deadline, jserve's `timeout` field, ended it) and "aborted" (the server aborted it).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Sequence
from typing import Any

from jserve.outputs import FinishReason, RequestOutput

# A finish reason that leaves the response incomplete -> incomplete_details.reason.
_INCOMPLETE = {
    FinishReason.LENGTH: "max_output_tokens",
    FinishReason.TIMEOUT: "timeout",
    FinishReason.ABORT: "aborted",
}


def response_usage(final: RequestOutput) -> dict[str, Any]:
    input_tokens = len(final.prompt_token_ids)
    output_tokens = sum(len(c.token_ids) for c in final.outputs)
    return {
        "input_tokens": input_tokens,
        "input_tokens_details": {"cached_tokens": final.num_cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": input_tokens + output_tokens,
    }


def function_call_item(call: dict[str, Any]) -> dict[str, Any]:
    """A `function_call` output item from a chat tool call (its `id` is the call_id)."""
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": "completed",
    }


class ResponseAssembler:
    """One response's output items and events. `base` holds the response object's fields
    that do not change (id, created_at, model, the request's settings echoed)."""

    def __init__(self, base: dict[str, Any]) -> None:
        self.base = base
        self.output: list[dict[str, Any]] = []
        self.events: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the open message item
        self._logprobs: list[dict[str, Any]] = []  # of tokens whose text has not come yet
        self.final: dict[str, Any] | None = None  # the response object, once finished
        self._sequence = 0

    def _event(self, kind: str, **fields: Any) -> None:
        self.events.append({"type": kind, "sequence_number": self._sequence, **fields})
        self._sequence += 1

    def snapshot(self, status: str, **fields: Any) -> dict[str, Any]:
        """The response object as it stands now."""
        return {**self.base, "status": status, "output": copy.deepcopy(self.output), **fields}

    def take_events(self) -> list[dict[str, Any]]:
        events, self.events = self.events, []
        return events

    def start(self) -> None:
        self._event("response.created", response=self.snapshot("in_progress"))
        self._event("response.in_progress", response=self.snapshot("in_progress"))

    def _added(self, item: dict[str, Any]) -> int:
        self.output.append(item)
        index = len(self.output) - 1
        self._event("response.output_item.added", output_index=index, item=copy.deepcopy(item))
        return index

    def _open_message(self) -> dict[str, Any]:
        item = {
            "type": "message",
            "id": f"msg_{uuid.uuid4().hex}",
            "status": "in_progress",
            "role": "assistant",
            "content": [],
        }
        index = self._added(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        self._event(
            "response.content_part.added", item_id=item["id"], output_index=index,
            content_index=0, part=copy.deepcopy(part),
        )  # fmt: skip
        self._message = item
        return item

    def add_text(self, delta: str, logprobs: Sequence[dict[str, Any]] = ()) -> None:
        """More of the message's text, and the logprobs of the tokens that came with it (a
        token whose text is held back lends its logprobs to the next text)."""
        self._logprobs += logprobs
        if not delta:
            return
        item = self._message or self._open_message()
        item["content"][0]["text"] += delta
        item["content"][0]["logprobs"] += self._logprobs
        self._event(
            "response.output_text.delta", item_id=item["id"], output_index=len(self.output) - 1,
            content_index=0, delta=delta, logprobs=self._logprobs,
        )  # fmt: skip
        self._logprobs = []

    def _close_message(self, status: str) -> None:
        item, self._message = self._message, None
        assert item is not None
        index, part = self.output.index(item), item["content"][0]
        part["logprobs"] += self._logprobs  # tokens with no text of their own: a stop's
        self._logprobs = []
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        self._event(
            "response.output_text.done", **where, text=part["text"],
            logprobs=copy.deepcopy(part["logprobs"]),
        )  # fmt: skip
        self._event("response.content_part.done", **where, part=copy.deepcopy(part))
        item["status"] = status
        self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def _add_call(self, call: dict[str, Any]) -> None:
        item = function_call_item(call)
        arguments = item["arguments"]
        index = self._added({**item, "arguments": "", "status": "in_progress"})
        self.output[index] = item
        where = {"item_id": item["id"], "output_index": index}
        self._event("response.function_call_arguments.delta", **where, delta=arguments)
        self._event(
            "response.function_call_arguments.done", **where, name=item["name"],
            arguments=arguments,
        )  # fmt: skip
        self._event("response.output_item.done", output_index=index, item=copy.deepcopy(item))

    def finish(
        self, calls: list[dict[str, Any]], finish_reason: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        """Close the output (the chat path's tool calls become function_call items) and
        return the final response object; its event is the last one."""
        reason = _INCOMPLETE.get(FinishReason(finish_reason)) if finish_reason else None
        status = "completed" if reason is None else "incomplete"
        if self._message is None and not calls:
            self._open_message()  # an empty answer is still a message
        if self._message is not None:
            self._close_message(status)
        for call in calls:
            self._add_call(call)
        response = self.snapshot(
            status,
            usage=usage,
            incomplete_details=None if reason is None else {"reason": reason},
        )
        self._event(f"response.{status}", response=response)
        self.final = response
        return response

    def fail(self, message: str) -> None:
        """The request failed after the stream started: a response.failed event."""
        error = {"code": "server_error", "message": message}
        self._event("response.failed", response=self.snapshot("failed", error=error))
