"""What the prefix cache did, as plain records: blocks stored, blocks removed, all cleared.

The block manager appends a record at the moment its prefix cache changes (a full block
indexed, a cached block evicted), so the log describes exactly the blocks a lookup can hit.
`jserve.kv_events.publisher` turns the records into vLLM's KV-event wire format and publishes
them; this module stays plain data so the core never depends on a transport.

Block hashes are the cache's 128-bit keys cut to the low 64 bits of their big-endian value,
the same conversion vLLM applies to its own keys before publishing them
(`maybe_convert_block_hash`). Consumers use them as names of blocks; they match request
tokens against the `token_ids` a store carries.
"""

from __future__ import annotations

from dataclasses import dataclass

_MASK_64 = (1 << 64) - 1


def external_block_hash(block_hash: bytes) -> int:
    """The published name of a cached block: its key's low 64 bits, as an unsigned int."""
    return int.from_bytes(block_hash, "big") & _MASK_64


@dataclass(frozen=True)
class BlocksStored:
    """Consecutive full blocks of one sequence entered the cache, in order.

    `parent_block_hash` names the cached block before the first one (None at the start of a
    sequence); `token_ids` are all the blocks' tokens, `block_size` per block.
    """

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    token_ids: tuple[int, ...]
    block_size: int


@dataclass(frozen=True)
class BlocksRemoved:
    """Cached blocks left the cache (evicted to make room); a lookup can no longer hit them."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached block is gone (the engine re-made its KV pool)."""


KVCacheEvent = BlocksStored | BlocksRemoved | AllBlocksCleared
