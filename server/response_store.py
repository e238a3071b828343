"""Stored responses of /v1/responses, in the server's memory, bounded.

A response created with `store` (OpenAI's default) is kept so a later request can continue
its conversation with `previous_response_id` and `GET /v1/responses/{id}` can return it. The
store holds at most `capacity` responses and evicts the least recently used (created, read or
continued) first; nothing survives a restart, and each server of a fleet has its own store.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from jserve.server.protocol_types import Message

DEFAULT_CAPACITY = 1000


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the response object as it was sent
    # The conversation so far as chat messages, this response's output last; without its
    # instructions, which OpenAI does not carry over to the next response.
    messages: tuple[Message, ...]


class ResponseStore:
    """Responses by id, least recently used evicted beyond `capacity`."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, stored: StoredResponse) -> None:
        self._items[stored.response["id"]] = stored
        self._items.move_to_end(stored.response["id"])
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        stored = self._items.get(response_id)
        if stored is not None:
            self._items.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> bool:
        return self._items.pop(response_id, None) is not None
