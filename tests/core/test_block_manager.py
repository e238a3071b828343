"""Block bookkeeping and the prefix cache, exercised directly on Request tables."""

from __future__ import annotations

from jserve.core.block_manager import SINK_BLOCK_ID, BlockManager
from jserve.core.prefix_cache import PrefixCache, hash_block_tokens
from jserve.core.request import Request

from .helpers import free_block_ids


def request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens)


def append_output_token(request: Request, token_id: int) -> None:
    """What the scheduler's update_from_output does with a sampled token."""
    request.output_token_ids.append(token_id)
    request.all_token_ids.append(token_id)


def compute(manager: BlockManager, req: Request, num_tokens: int) -> None:
    """What a step does to a request: allocate and index its full blocks (planning), then
    mark the tokens computed (after the model ran)."""
    assert manager.allocate(req, num_tokens)
    manager.cache_full_blocks(req, req.num_computed_tokens + num_tokens)
    req.num_computed_tokens += num_tokens


def test_sink_is_never_handed_out_and_ids_start_at_one():
    manager = BlockManager(num_blocks=5, block_size=2, enable_prefix_caching=False)
    req = request("a", list(range(8)))
    assert manager.num_free_blocks == 4
    assert manager.allocate(req, 8)
    assert req.block_ids == [1, 2, 3, 4]
    assert SINK_BLOCK_ID not in req.block_ids
    assert not manager.allocate(request("b", [1]), 1)  # pool empty: the sink stays reserved
    assert manager.usage() == 1.0


def test_allocate_counts_partial_blocks_and_fails_without_change():
    manager = BlockManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    req = request("a", list(range(20)))
    assert manager.blocks_needed(req, 5) == 2
    assert manager.allocate(req, 5)
    req.num_computed_tokens = 5
    assert manager.blocks_needed(req, 3) == 0  # 8 tokens still fit in 2 blocks
    assert manager.blocks_needed(req, 4) == 1
    assert not manager.allocate(req, 8)  # needs 2 more, only 1 free
    assert req.block_ids == [1, 2] and manager.num_free_blocks == 1


def test_free_returns_blocks_and_fork_shares_them():
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    leader = request("a", list(range(6)))
    compute(manager, leader, 6)
    sibling = request("b", list(range(6)))
    manager.fork(sibling, leader.block_ids[:2])
    assert sibling.num_computed_tokens == 4
    assert [manager.ref_counts[b] for b in leader.block_ids] == [2, 2, 1]
    manager.free(leader)
    assert leader.block_ids == []
    assert [manager.ref_counts[b] for b in sibling.block_ids] == [1, 1]
    assert manager.num_free_blocks == 7 - 2
    manager.free(sibling)
    assert manager.num_free_blocks == 7 and free_block_ids(manager) == set(range(1, 8))


def test_prefix_hit_reuses_full_blocks_and_leaves_one_token():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    first = request("a", list(range(12)))
    compute(manager, first, 12)
    assert len(manager.prefix_cache) == 3
    # Same 12 tokens: only 2 blocks may be reused, the last token must be computed.
    same = request("b", list(range(12)))
    hits = manager.lookup_prefix(same)
    assert hits == first.block_ids[:2]
    manager.use_prefix(same, hits)
    assert same.num_computed_tokens == 8
    assert (manager.prefix_cache.queries, manager.prefix_cache.hits) == (12, 8)
    # Diverging in the second block: only the first block matches.
    other = request("c", [*range(5), 99, *range(6, 14)])
    assert manager.lookup_prefix(other) == first.block_ids[:1]


def test_hash_chains_the_parent():
    a = hash_block_tokens(None, [1, 2])
    assert a == hash_block_tokens(None, [1, 2])
    assert hash_block_tokens(a, [3, 4]) != hash_block_tokens(None, [3, 4])
    assert len(a) == 16


def test_token_equality_guards_against_a_hash_collision(monkeypatch):
    monkeypatch.setattr(
        "jserve.core.block_manager.hash_block_tokens", lambda parent, tokens, salt=None: b"same"
    )
    manager = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    compute(manager, request("a", [1, 2, 3]), 3)
    assert manager.lookup_prefix(request("b", [5, 6, 7])) == []  # same key, other tokens
    assert manager.lookup_prefix(request("c", [1, 2, 9])) != []


def test_a_cache_salt_shares_blocks_only_with_its_own_salt():
    """vLLM's cache_salt: the same tokens under another salt (or none) find nothing cached,
    under the same salt all of it; the salt keys the first block and the chain carries it."""
    manager = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    tokens = [1, 2, 3, 4, 5]
    compute(manager, Request("a", tokens, cache_salt="s3cret"), 5)
    assert len(manager.lookup_prefix(Request("same", tokens, cache_salt="s3cret"))) == 2
    for other in (None, "other", "s3cre"):
        assert manager.lookup_prefix(Request("b", tokens, cache_salt=other)) == [], other
    compute(manager, request("c", tokens), 5)  # unsalted: its own blocks, found unsalted
    assert len(manager.lookup_prefix(request("d", tokens))) == 2
    assert hash_block_tokens(None, [1, 2], "x") not in (
        hash_block_tokens(None, [1, 2]), hash_block_tokens(None, [1, 2], "y")
    )  # fmt: skip


def test_output_blocks_are_cached_once_full():
    manager = BlockManager(num_blocks=16, block_size=4, enable_prefix_caching=True)
    req = request("a", [1, 2, 3])
    compute(manager, req, 3)
    for token in (4, 5, 6):
        append_output_token(req, token)
        compute(manager, req, 1)  # decode: one token per step
    assert req.num_hashed_blocks == 1  # tokens 1..4 computed; 5, 6 not a full block
    append_output_token(req, 7)
    compute(manager, req, 1)
    assert req.num_hashed_blocks == 1 and len(manager.prefix_cache) == 1
    append_output_token(req, 8)
    compute(manager, req, 1)
    assert len(manager.prefix_cache) == 2
    assert manager.lookup_prefix(request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9])) == req.block_ids[:2]


def test_lru_eviction_prefers_free_blocks_then_least_recently_released():
    manager = BlockManager(num_blocks=7, block_size=2, enable_prefix_caching=True)
    old = request("old", [1, 2, 3, 4])  # 2 cached blocks, released first
    new = request("new", [5, 6, 7, 8])  # 2 cached blocks, released later
    compute(manager, old, 4)
    compute(manager, new, 4)
    old_blocks, new_blocks = list(old.block_ids), list(new.block_ids)
    manager.free(old)
    manager.free(new)
    assert manager.num_free_blocks == 6 and len(manager.prefix_cache) == 4
    taker = request("taker", list(range(100, 112)))
    compute(manager, taker, 4)  # 2 plain free blocks first: nothing evicted
    assert all(manager.prefix_cache.is_cached(b) for b in old_blocks + new_blocks)
    compute(manager, taker, 2)  # then the least recently released: old's tail first
    assert taker.block_ids[2] == old_blocks[1]
    assert manager.lookup_prefix(request("x", [1, 2, 3, 4, 0])) == [old_blocks[0]]
    assert manager.lookup_prefix(request("y", [5, 6, 7, 8, 0])) == new_blocks


def test_a_hit_on_an_evictable_block_takes_it_out_of_the_free_pool():
    manager = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    compute(manager, first := request("a", [1, 2, 3]), 3)
    manager.free(first)
    assert manager.num_free_blocks == 3
    again = request("b", [1, 2, 3])
    hits = manager.lookup_prefix(again)
    assert manager.num_reused_free(hits) == 1
    manager.use_prefix(again, hits)
    assert manager.ref_counts[hits[0]] == 1 and manager.num_free_blocks == 2
    assert hits[0] not in free_block_ids(manager)


def test_prefix_cache_keeps_the_first_block_for_a_duplicate_key():
    cache = PrefixCache()
    cache.insert(b"k", 3, (1, 2))
    cache.insert(b"k", 4, (1, 2))
    assert cache.get(b"k", (1, 2)) == 3
    assert not cache.is_cached(4)
