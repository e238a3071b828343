"""Publish the prefix cache's changes as vLLM KV-cache events over ZMQ, for KV-aware routers.

The wire format is vLLM's (matched against vLLM 0.32.0, `vllm/distributed/kv_events.py`),
which NVIDIA Dynamo's, llm-d's and vllm-router's KV-aware routers consume:
- a PUB socket sends one multipart message per engine step that changed the cache:
  `[topic, seq, payload]`, where `seq` is an 8-byte big-endian counter from 0 and `payload`
  is a msgpack `KVEventBatch` (a msgspec Struct encoded as an array `[ts, events, dp_rank]`);
  each event is a tagged map: `{"type": "BlockStored", "block_hashes": [...], ...}`,
  `{"type": "BlockRemoved", ...}` or `{"type": "AllBlocksCleared"}`;
- an optional ROUTER socket answers a replay request (`[b"", start_seq]` from a REQ or DEALER
  client) with every buffered batch from `start_seq` on, as `[b"", topic, seq, payload]`, then
  an end marker `[b"", b"", seq -1, b""]`.

`medium` is "GPU", vLLM's name for the engine's own KV pool (jserve's, whatever the device):
the routers give blocks on other media (CPU offload, disk) less credit.

Walkthrough: the engine's step thread calls `publish` with the records the block manager
logged (jserve.kv_events.records); a daemon thread owns both sockets (ZMQ sockets are not
thread-safe), numbers and sends each batch, keeps the last `buffer_steps` for replay, and polls
the replay socket between batches. `close` sends what is queued and stops.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import msgspec
import zmq

from jserve.kv_events import records

log = logging.getLogger(__name__)

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):  # type: ignore[call-arg]
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # type: ignore[call-arg]
    """Base of the events; `tag=True` adds `"type": <class name>` to each encoded map."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def to_wire(event: records.KVCacheEvent) -> BlockStored | BlockRemoved | AllBlocksCleared:
    """The vLLM event for one record (one KV-cache group, index 0, no LoRA), as vLLM fills it."""
    if isinstance(event, records.BlocksStored):
        return BlockStored(
            block_hashes=list(event.block_hashes), parent_block_hash=event.parent_block_hash,
            token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None,
            medium=MEDIUM, lora_name=None, group_idx=0,
        )  # fmt: skip
    if isinstance(event, records.BlocksRemoved):
        return BlockRemoved(block_hashes=list(event.block_hashes), medium=MEDIUM, group_idx=0)
    return AllBlocksCleared()


class ZmqEventPublisher:
    """PUB socket at `endpoint` (bound), optional ROUTER replay socket at `replay_endpoint`."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
    ) -> None:
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"cannot bind the KV-events socket: {e}") from e
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = (
            self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        )
        self._thread = threading.Thread(target=self._run, name="jserve-kv-events", daemon=True)
        self._thread.start()
        log.info("publishing KV-cache events on %s (replay: %s)", self.endpoint,
                 self.replay_endpoint)  # fmt: skip

    def publish(self, events: list[records.KVCacheEvent]) -> None:
        """Queue one batch (one engine step's changes); nothing is sent for an empty list."""
        if events:
            batch = KVEventBatch(time.time(), [to_wire(e) for e in events], self._rank)
            self._queue.put(batch)

    def close(self) -> None:
        """Send what is queued, then stop the thread and close the sockets."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        try:
            while True:
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                try:
                    batch = self._queue.get(timeout=0.05)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = encoder.encode(batch)
                seq_bytes = seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq_bytes, payload))
                self._buffer.append((seq, payload))
                seq += 1
        except Exception:  # the engine must go on serving without its event stream
            log.exception("KV-events publisher failed; no further events are sent")
        finally:
            self._close_sockets()

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("ignoring a malformed KV-events replay request (%d frames)", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"),
                                             payload))  # fmt: skip
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=200)  # ms to flush batches already handed to ZMQ
        if self._replay is not None:
            self._replay.close(linger=0)
