"""KV block bookkeeping: ref counts, a free list, the padding sink and request block tables.

Block `SINK_BLOCK_ID` is never handed out: the runtime points padding slots at it, so padding
can never touch a live cache entry. A block is either referenced (ref count > 0, held by
request tables; shared blocks are full and never written again) or free: on the plain free
list, or - when it holds a cached full block - evictable in the prefix cache.
"""

from __future__ import annotations

from array import array

from jserve.core.prefix_cache import PrefixCache, hash_block_tokens
from jserve.core.request import Request
from jserve.kv_events.records import (
    BlocksRemoved,
    BlocksStored,
    KVCacheEvent,
    external_block_hash,
)

SINK_BLOCK_ID = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        # int64 arrays rather than lists: the garbage collector never walks them, where two
        # lists of a large pool's blocks would be walked by every full collection.
        self.ref_counts = array("q", bytes(8 * num_blocks))
        # A stack whose top is the lowest id, so a fresh pool hands out 1, 2, 3, ...
        self._free = array("q", range(num_blocks - 1, SINK_BLOCK_ID, -1))
        self.prefix_cache = PrefixCache() if enable_prefix_caching else None
        # What the prefix cache did since the last take_kv_events(); None: nobody listens.
        self._kv_events: list[KVCacheEvent] | None = None

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: plain free ones plus evictable cached ones."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    def usage(self) -> float:
        """Fraction of usable blocks referenced by requests (cached-but-unused ones count free)."""
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """New blocks `request` needs to compute `num_new_tokens` more tokens."""
        num_tokens = request.num_computed_tokens + num_new_tokens
        return -(-num_tokens // self.block_size) - len(request.block_ids)

    def allocate(self, request: Request, num_new_tokens: int) -> bool:
        """Grow the table for `num_new_tokens` more tokens; False (and no change) if short."""
        needed = self.blocks_needed(request, num_new_tokens)
        if needed > self.num_free_blocks:
            return False
        for _ in range(needed):
            request.block_ids.append(self._take_free_block())
        return True

    def lookup_prefix(self, request: Request) -> list[int]:
        """Cached blocks of the longest cached prefix of `request`'s known tokens.

        Leaves at least one token to compute, because the step that computes the last known
        token is the one that samples the next. Takes no references (see `use_prefix`).
        """
        cache = self.prefix_cache
        if cache is None:
            return []
        size = self.block_size
        hits: list[int] = []
        for index in range((request.num_tokens - 1) // size):
            start = index * size
            block_id = cache.get(
                self.block_hash(request, index), tuple(request.all_token_ids[start : start + size])
            )
            if block_id is None:
                break
            hits.append(block_id)
        return hits

    def num_reused_free(self, block_ids: list[int]) -> int:
        """How many of `block_ids` are free now, so reusing them shrinks the free pool."""
        return sum(1 for block_id in block_ids if self.ref_counts[block_id] == 0)

    def use_prefix(self, request: Request, hit_block_ids: list[int]) -> None:
        """Start `request`'s table with cached blocks and count the lookup in the cache stats."""
        assert self.prefix_cache is not None and not request.block_ids
        for block_id in hit_block_ids:
            if self.ref_counts[block_id] == 0:
                self.prefix_cache.reuse(block_id)
            self.ref_counts[block_id] += 1
        request.block_ids = list(hit_block_ids)
        request.num_hashed_blocks = len(hit_block_ids)
        request.num_computed_tokens = len(hit_block_ids) * self.block_size
        self.prefix_cache.queries += request.num_tokens
        self.prefix_cache.hits += request.num_computed_tokens

    def fork(self, request: Request, shared_block_ids: list[int]) -> None:
        """Start `request`'s table with another request's full, already computed blocks."""
        assert not request.block_ids
        for block_id in shared_block_ids:
            self.ref_counts[block_id] += 1
        request.block_ids = list(shared_block_ids)
        request.num_computed_tokens = len(shared_block_ids) * self.block_size
        request.num_hashed_blocks = len(shared_block_ids) if self.prefix_cache else 0

    def free(self, request: Request) -> None:
        """Drop `request`'s references, tail first so a prefix outlives its suffix in the LRU."""
        cache = self.prefix_cache
        ref_counts = self.ref_counts
        for block_id in reversed(request.block_ids):
            ref_counts[block_id] -= 1
            if ref_counts[block_id] == 0:
                if cache is not None and cache.is_cached(block_id):
                    cache.release(block_id)
                else:
                    self._free.append(block_id)
        # A new list, not clear(): a StepPlan handed out earlier keeps its view of the table.
        request.block_ids = []
        request.num_hashed_blocks = 0

    def truncate(self, request: Request, num_blocks: int) -> None:
        """Drop `request`'s blocks past its first `num_blocks` (rejected drafts' slots): they
        hold no known token, so none of them is in the prefix cache."""
        if len(request.block_ids) <= num_blocks:
            return
        for block_id in request.block_ids[num_blocks:]:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free.append(block_id)
        # A new list, not del: a StepPlan handed out earlier keeps its view of the table.
        request.block_ids = request.block_ids[:num_blocks]

    def record_kv_events(self) -> None:
        """From now on, log every change of the prefix cache (see jserve.kv_events.records)."""
        if self.prefix_cache is not None and self._kv_events is None:
            self._kv_events = []

    @property
    def records_kv_events(self) -> bool:
        return self._kv_events is not None

    def take_kv_events(self) -> list[KVCacheEvent]:
        """The changes logged since the last call, oldest first."""
        events = self._kv_events
        if not events:
            return []
        self._kv_events = []
        return events

    def cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the full blocks among `request`'s first `num_tokens` tokens not indexed yet.

        The scheduler calls this when it plans the step that computes those tokens, as vLLM
        commits blocks when it allocates them: the cache (and its KV events, which routers
        read) then knows the blocks one step earlier. No step can read them before that step
        ran: the next lookup plans a later step (with async scheduling, while that step runs;
        steps run in order).
        """
        cache = self.prefix_cache
        num_full = num_tokens // self.block_size
        if cache is None or num_full <= request.num_hashed_blocks:
            return
        size = self.block_size
        stored: list[int] = []  # indices of the blocks this call indexed
        for index in range(request.num_hashed_blocks, num_full):
            start = index * size
            if cache.insert(
                self.block_hash(request, index),
                request.block_ids[index],
                tuple(request.all_token_ids[start : start + size]),
            ):
                stored.append(index)
        if self._kv_events is not None and stored:
            self._log_stored(request, stored)
        request.num_hashed_blocks = num_full

    def _log_stored(self, request: Request, indices: list[int]) -> None:
        """One BlocksStored per run of consecutive indexed blocks (a duplicate breaks a run)."""
        size, hashes = self.block_size, request.block_hashes
        runs: list[list[int]] = []
        for index in indices:
            if runs and runs[-1][-1] == index - 1:
                runs[-1].append(index)
            else:
                runs.append([index])
        for run in runs:
            first = run[0]
            self._kv_events.append(  # type: ignore[union-attr]
                BlocksStored(
                    tuple(external_block_hash(hashes[i]) for i in run),
                    external_block_hash(hashes[first - 1]) if first else None,
                    tuple(request.all_token_ids[first * size : (run[-1] + 1) * size]),
                    size,
                )
            )

    def block_hash(self, request: Request, index: int) -> bytes:
        """The prefix cache's key of `request`'s full block `index` (memoized on the request)."""
        hashes = request.block_hashes
        size = self.block_size
        while len(hashes) <= index:
            start = len(hashes) * size
            tokens = request.all_token_ids[start : start + size]
            if hashes:
                hashes.append(hash_block_tokens(hashes[-1], tokens))
            else:
                hashes.append(hash_block_tokens(None, tokens, request.cache_salt))
        return hashes[index]

    def _take_free_block(self) -> int:
        if self._free:
            block_id = self._free.pop()
        else:
            assert self.prefix_cache is not None, "allocate() checked num_free_blocks"
            block_id, block_hash = self.prefix_cache.evict_lru()
            if self._kv_events is not None:
                self._kv_events.append(BlocksRemoved((external_block_hash(block_hash),)))
        self.ref_counts[block_id] = 1
        return block_id
