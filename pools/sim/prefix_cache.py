"""The prefix cache: which KV blocks hold which full-block token content, keyed by chained block hashes.

Kept apart from block allocation (`kv.py`) because its two operations, store and evict, are exactly what vLLM
publishes as KV-cache events (BlockStored / BlockRemoved / AllBlocksCleared): a `CacheEventSink` attached here will
see every one of them, in order, without the allocator knowing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import xxhash

from pools.sim.tokenizer import Tokens

ROOT_HASH = 0x6D33676174650000  # the chain's parent for a first block ("NONE_HASH")


def block_hashes(tokens: Tokens, block_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained 64-bit hashes of every *full* block of the prompt: block k's hash covers tokens [0, (k+1)·size).

    The salt is mixed into the first block only, as vLLM does with `cache_salt`, so salted prompts never share."""
    hashes: list[int] = []
    parent = ROOT_HASH
    salt = cache_salt.encode() if cache_salt else b""
    for k in range(tokens.count // block_size):
        data = tokens.span_bytes(k * block_size, (k + 1) * block_size)
        if k == 0 and salt:
            data += b"\xffsalt" + salt
        parent = xxhash.xxh3_64_intdigest(data, seed=parent)
        hashes.append(parent)
    return hashes


class CacheEventSink(Protocol):
    """Receives the cache's changes; a future ZMQ publisher implements this."""

    def blocks_stored(self, parent_hash: int | None, hashes: Sequence[int], block_ids: Sequence[int]) -> None: ...

    def block_removed(self, block_hash: int) -> None: ...

    def all_cleared(self) -> None: ...


class PrefixCache:
    """hash → block id for full blocks whose KV may be reused. Which of them may be evicted is the allocator's call."""

    def __init__(self, sink: CacheEventSink | None = None) -> None:
        self._blocks: dict[int, int] = {}
        self.sink = sink

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._blocks

    def longest_hit(self, hashes: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `hashes`, at most `max_blocks` long."""
        hit: list[int] = []
        blocks = self._blocks
        for h in hashes[:max_blocks]:
            block = blocks.get(h)
            if block is None:
                break
            hit.append(block)
        return hit

    def store(self, parent_hash: int | None, hashes: Sequence[int], block_ids: Sequence[int]) -> list[bool]:
        """Register newly filled blocks; a hash already cached (same content computed twice) keeps its first block.

        Returns, per block, whether it now backs its hash (duplicates do not and stay plain blocks)."""
        stored_h: list[int] = []
        stored_b: list[int] = []
        result: list[bool] = []
        for h, b in zip(hashes, block_ids):
            if h in self._blocks:
                result.append(self._blocks[h] == b)
                continue
            self._blocks[h] = b
            stored_h.append(h)
            stored_b.append(b)
            result.append(True)
        if stored_h and self.sink is not None:
            self.sink.blocks_stored(parent_hash, stored_h, stored_b)
        return result

    def evict(self, block_hash: int) -> None:
        if self._blocks.pop(block_hash, None) is not None and self.sink is not None:
            self.sink.block_removed(block_hash)

    def clear(self) -> None:
        self._blocks.clear()
        if self.sink is not None:
            self.sink.all_cleared()
