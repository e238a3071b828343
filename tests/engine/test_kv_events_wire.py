"""KV-cache events on the wire: vLLM's layout, sequence numbers, replay, and the cache state.

The stream is decoded twice: as raw msgpack (so the test pins the exact layout vLLM 0.32.0's
consumers parse: an array batch of tagged maps) and as the typed batch.
"""

from __future__ import annotations

import random
import time

import msgspec
import pytest
import zmq

from jserve.core.block_manager import BlockManager
from jserve.kv_events.publisher import END_SEQ, KVEventBatch, ZmqEventPublisher
from jserve.kv_events.records import AllBlocksCleared, BlocksRemoved, BlocksStored
from tests.core.test_kv_cache_events import cache_contents, run_operations


@pytest.fixture
def publisher():
    pub = ZmqEventPublisher("tcp://127.0.0.1:*", "tcp://127.0.0.1:*", topic="kv")
    yield pub
    pub.close()


def replay(endpoint: str, start_seq: int) -> list[tuple[bytes, int, bytes]]:
    """Ask the replay socket for every batch from `start_seq`, as a REQ-style DEALER does."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    try:
        sock.send_multipart((b"", start_seq.to_bytes(8, "big")))
        batches = []
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            assert empty == b""
            if seq == END_SEQ:
                assert topic == b"" and payload == b""
                return batches
            batches.append((topic, int.from_bytes(seq, "big"), payload))
    finally:
        sock.close(linger=0)


def test_batches_have_vllms_layout_and_consecutive_sequence_numbers(publisher):
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(publisher.endpoint)
    time.sleep(0.3)  # a SUB socket misses what is sent before it has joined
    stored = BlocksStored((11, 12), None, (1, 2, 3, 4), 2)
    publisher.publish([stored, BlocksRemoved((11,))])
    publisher.publish([])  # an empty step sends nothing
    publisher.publish([AllBlocksCleared()])
    received = []
    for _ in range(2):
        assert sub.poll(5000)
        received.append(sub.recv_multipart())
    sub.close(linger=0)
    assert [(topic, int.from_bytes(seq, "big")) for topic, seq, _ in received] == [
        (b"kv", 0),
        (b"kv", 1),
    ]
    ts, events, rank = msgspec.msgpack.decode(received[0][2])
    assert abs(ts - time.time()) < 60 and rank == 0
    assert events == [
        {"type": "BlockStored", "block_hashes": [11, 12], "parent_block_hash": None,
         "token_ids": [1, 2, 3, 4], "block_size": 2, "lora_id": None, "medium": "GPU",
         "lora_name": None, "group_idx": 0},
        {"type": "BlockRemoved", "block_hashes": [11], "medium": "GPU", "group_idx": 0},
    ]  # fmt: skip
    assert msgspec.msgpack.decode(received[1][2])[1] == [{"type": "AllBlocksCleared"}]
    assert replay(publisher.replay_endpoint, 1) == [(b"kv", 1, received[1][2])]


def test_replayed_stream_rebuilds_the_cache_after_random_operations(publisher):
    manager = BlockManager(num_blocks=10, block_size=4, enable_prefix_caching=True)
    manager.record_kv_events()
    rng = random.Random(7)
    operations = [
        (rng.randrange(4), rng.randrange(10), rng.randrange(1, 25), rng.random() < 0.5)
        for _ in range(60)
    ]
    run_operations(manager, operations, lambda: publisher.publish(manager.take_kv_events()))
    publisher.publish([AllBlocksCleared()])
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    blocks: dict[int, tuple[int, ...]] = {}
    cleared = msgspec.msgpack.encode({"type": "AllBlocksCleared"})
    deadline = time.monotonic() + 10
    while True:  # the publisher thread sends asynchronously: wait for the final batch
        batches = replay(publisher.replay_endpoint, 0)
        if (batches and cleared in batches[-1][2]) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert [seq for _, seq, _ in batches] == list(range(len(batches)))
    snapshot_at = len(batches) - 1  # the state before the final clear
    for i, (_, _, payload) in enumerate(batches):
        if i == snapshot_at:
            assert blocks == cache_contents(manager)
            assert blocks, "the random operations cached nothing: the check is empty"
        for event in decoder.decode(payload).events:
            if type(event).__name__ == "BlockStored":
                size = event.block_size
                for j, h in enumerate(event.block_hashes):
                    blocks[h] = tuple(event.token_ids[j * size : (j + 1) * size])
            elif type(event).__name__ == "BlockRemoved":
                for h in event.block_hashes:
                    del blocks[h]
            else:
                blocks.clear()
    assert blocks == {}


def test_a_bad_endpoint_is_a_clear_error():
    with pytest.raises(ValueError, match="cannot bind the KV-events socket"):
        ZmqEventPublisher("not-an-endpoint")
