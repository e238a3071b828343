"""The block manager's KV-event log replays to exactly the prefix cache's contents."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from jserve.core.block_manager import BlockManager
from jserve.core.request import Request
from jserve.kv_events.records import (
    AllBlocksCleared,
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    external_block_hash,
)
from tests.budgets import examples

BLOCK = 4


class CacheMirror:
    """What a router knows of one worker's cache: hash -> token ids, from the events alone."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple[int, ...]] = {}

    def apply(self, events: list[KVCacheEvent]) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                assert len(event.token_ids) == len(event.block_hashes) * event.block_size
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * event.block_size : (i + 1) * event.block_size]
                    assert block_hash not in self.blocks, "a block stored twice"
                    self.blocks[block_hash] = tokens
            elif isinstance(event, BlocksRemoved):
                for block_hash in event.block_hashes:
                    assert self.blocks.pop(block_hash, None) is not None, "removed unknown block"
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()


def cache_contents(manager: BlockManager) -> dict[int, tuple[int, ...]]:
    """The prefix cache's own state, named the way the events name it."""
    cache = manager.prefix_cache
    assert cache is not None
    return {
        external_block_hash(block_hash): cache._tokens_of_block[block_id]
        for block_hash, block_id in cache._block_of_hash.items()
    }


# One operation: (prefix index, own-token count, tokens to compute, free afterwards?)
OPERATION = st.tuples(st.integers(0, 3), st.integers(0, 9), st.integers(1, 24), st.booleans())
PREFIXES = [list(range(100 * p, 100 * p + 10)) for p in range(4)]


def run_operations(manager: BlockManager, operations: list, check) -> None:
    """Admit requests sharing prefixes (with cache hits), compute chunks, free some; after each
    operation call `check()`. Requests left running hold their blocks, so eviction happens."""
    live: list[Request] = []
    for n, (prefix, own, compute, free) in enumerate(operations):
        tokens = PREFIXES[prefix] + [1000 + 10 * n + i for i in range(own)]
        req = Request(f"r{n}", tokens)
        hits = manager.lookup_prefix(req)
        if manager.num_free_blocks - manager.num_reused_free(hits) < 1:
            for old in live:  # make room the way a preemption would
                manager.free(old)
            live.clear()
        manager.use_prefix(req, hits)
        todo = min(compute, req.num_tokens - req.num_computed_tokens)
        if manager.allocate(req, todo):
            manager.cache_full_blocks(req, req.num_computed_tokens + todo)
            req.num_computed_tokens += todo
        if free:
            manager.free(req)
        else:
            live.append(req)
        check()


@examples(150)
@given(st.lists(OPERATION, min_size=1, max_size=40), st.integers(3, 12))
def test_events_replay_to_the_cache_contents(operations, num_blocks):
    manager = BlockManager(num_blocks=num_blocks, block_size=BLOCK, enable_prefix_caching=True)
    manager.record_kv_events()
    mirror = CacheMirror()

    def check() -> None:
        mirror.apply(manager.take_kv_events())
        assert mirror.blocks == cache_contents(manager)

    run_operations(manager, operations, check)


def test_stored_events_chain_their_parents_and_evictions_are_removals():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    manager.record_kv_events()
    first = Request("a", [1, 2, 3, 4, 5])
    assert manager.allocate(first, 5)
    manager.cache_full_blocks(first, 5)
    (stored,) = manager.take_kv_events()
    hashes = [external_block_hash(h) for h in first.block_hashes[:2]]
    assert stored == BlocksStored(tuple(hashes), None, (1, 2, 3, 4), 2)
    manager.free(first)
    # The next request needs every block: the two cached ones are evicted, LRU first (the
    # tail was released first, so the suffix block goes before the prefix block).
    second = Request("b", [9] * 6)
    assert manager.allocate(second, 6)
    assert manager.take_kv_events() == [
        BlocksRemoved((hashes[1],)),
        BlocksRemoved((hashes[0],)),
    ]


def test_a_continuation_names_the_cached_parent():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    manager.record_kv_events()
    req = Request("a", [1, 2, 3, 4, 5, 6])
    assert manager.allocate(req, 6)
    manager.cache_full_blocks(req, 2)
    manager.cache_full_blocks(req, 6)
    first, second = manager.take_kv_events()
    names = [external_block_hash(h) for h in req.block_hashes]
    assert first.block_hashes == (names[0],) and first.parent_block_hash is None
    assert second.block_hashes == (names[1], names[2]) and second.parent_block_hash == names[0]
    assert second.token_ids == (3, 4, 5, 6)


def test_nothing_is_logged_unless_asked():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    req = Request("a", [1, 2, 3, 4])
    assert manager.allocate(req, 4)
    manager.cache_full_blocks(req, 4)
    assert manager.take_kv_events() == []
