"""Content-addressed index of full KV blocks, with LRU eviction of the unreferenced ones.

A block's key chains its parent's key and its own token ids, so equal keys mean equal
prefixes; a request's `cache_salt` (vLLM's) goes into its first block's key, so requests share
blocks only with requests of the same salt (a tenant with a secret salt cannot be probed, by
another's cache hits or their timing, for the prompts it sent). The key is a 128-bit BLAKE2b
digest: a collision would need a cryptographic break (Python's `hash()` can be steered by a
client choosing tokens), and a hit still compares the block's token ids as a second guard.

The cache holds no references: a cached block is "in use" through the ref counts of the
request tables that hold it, and "evictable" (listed here, LRU first) once none do. The block
manager takes evictable blocks only after its plain free list is empty.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

_ROOT_HASH = b"\0" * 16


def hash_block_tokens(
    parent_hash: bytes | None, token_ids: Sequence[int], salt: str | None = None
) -> bytes:
    """Key of one full block. `parent_hash` is None for a sequence's first block, the only one
    whose key takes the `salt` (after the block's fixed number of tokens: no ambiguity)."""
    digest = hashlib.blake2b(parent_hash or _ROOT_HASH, digest_size=16)
    digest.update(token_ids if isinstance(token_ids, array) else array("q", token_ids))
    if salt is not None:
        digest.update(salt.encode("utf-8", "surrogatepass"))
    return digest.digest()


class PrefixCache:
    """Maps block keys to block ids; counts looked-up and hit tokens like vLLM's metrics."""

    def __init__(self) -> None:
        self._block_of_hash: dict[bytes, int] = {}
        self._hash_of_block: dict[int, bytes] = {}
        # Tuples of ints, which the garbage collector stops tracking: a full cache then adds
        # nothing to the cost of a full collection (lists of tokens made it grow with the cache).
        self._tokens_of_block: dict[int, tuple[int, ...]] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref count 0, LRU first
        self.queries = 0  # tokens of admitted requests that were looked up
        self.hits = 0  # of those, tokens found in the cache

    def __len__(self) -> int:
        return len(self._block_of_hash)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def get(self, block_hash: bytes, token_ids: tuple[int, ...]) -> int | None:
        """Block id cached under `block_hash` whose tokens equal `token_ids`, else None."""
        block_id = self._block_of_hash.get(block_hash)
        if block_id is None or self._tokens_of_block[block_id] != token_ids:
            return None
        return block_id

    def insert(self, block_hash: bytes, block_id: int, token_ids: tuple[int, ...]) -> bool:
        """Index a freshly computed full block; keeps the existing entry for a duplicate key.

        Returns whether the block was indexed (False for a duplicate)."""
        if block_hash in self._block_of_hash or block_id in self._hash_of_block:
            return False
        self._block_of_hash[block_hash] = block_id
        self._hash_of_block[block_id] = block_hash
        self._tokens_of_block[block_id] = token_ids
        return True

    def is_cached(self, block_id: int) -> bool:
        return block_id in self._hash_of_block

    def release(self, block_id: int) -> None:
        """The last reference to a cached block went away: it becomes the newest evictable."""
        self._evictable[block_id] = None

    def reuse(self, block_id: int) -> None:
        """An evictable block got a reference again (a prefix hit)."""
        del self._evictable[block_id]

    def evict_lru(self) -> tuple[int, bytes]:
        """Forget the least recently released cached block; hand out its id and former key."""
        block_id, _ = self._evictable.popitem(last=False)
        block_hash = self._hash_of_block.pop(block_id)
        del self._block_of_hash[block_hash]
        del self._tokens_of_block[block_id]
        return block_id, block_hash
