"""Paged KV-cache bookkeeping: fixed-size blocks, a free pool, ref counts and prefix-cache hashes.

This class owns no tensors; the runner holds the cache tensors and the BatchTable holds each
request's block table. A block is either owned (ref count > 0) or in the free pool. With prefix
caching, a full block also carries a content hash chained through its predecessors' hashes, and
stays findable in the free pool after its last owner lets go, until the pool needs it back:
least recently freed first, un-hashed blocks before hashed ones.
"""
from __future__ import annotations

import hashlib
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np


def hash_block(parent: bytes | None, token_ids: Sequence[int], extra_key: bytes) -> bytes:
    """Content hash of one full block: its tokens, everything before it (through the parent's
    hash), and an extra key that keeps models and cache salts apart. 128-bit blake2b, so a
    collision (which would hand one prompt another's KV) is not a practical concern."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or extra_key)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks > 0 and block_size > 0
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.free_pool: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}     # hash -> block holding that content

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_pool)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_pool)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int]:
        """Take n blocks from the pool (evicting their cached content); the caller checked room."""
        assert n <= len(self.free_pool), f"allocate({n}) with {len(self.free_pool)} free"
        blocks = []
        for _ in range(n):
            block, _ = self.free_pool.popitem(last=False)
            if self.block_hash[block] is not None:
                del self.cached[self.block_hash[block]]
                self.block_hash[block] = None
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def free(self, blocks: Sequence[int]) -> None:
        """Drop one reference to each block. Freed blocks join the pool tail-first, so a later
        eviction takes a sequence's tail before its head; un-hashed blocks go to the front."""
        for block in reversed(blocks):
            count = self.ref_counts[block] - 1
            assert count >= 0, f"block {block} freed twice"
            self.ref_counts[block] = count
            if count == 0:
                self.free_pool[block] = None
                if self.block_hash[block] is None:
                    self.free_pool.move_to_end(block, last=False)

    def find_cached_prefix(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The blocks holding the longest cached prefix of these hashes (no references taken)."""
        blocks = []
        for block_hash in block_hashes:
            block = self.cached.get(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def acquire(self, blocks: Iterable[int]) -> None:
        """Take a reference to cached blocks (reviving them from the free pool if needed)."""
        for block in blocks:
            if self.ref_counts[block] == 0:
                del self.free_pool[block]
            self.ref_counts[block] += 1

    def cache_block(self, block: int, block_hash: bytes) -> None:
        """Make a full block findable by its content hash (first writer wins on duplicates)."""
        if self.block_hash[block] is None and block_hash not in self.cached:
            self.cached[block_hash] = block
            self.block_hash[block] = block_hash

    def count_free_among(self, blocks: Iterable[int]) -> int:
        return sum(1 for block in blocks if self.ref_counts[block] == 0)

    def check_invariants(self, owners: Iterable[Sequence[int]]) -> None:
        """Every block is free or owned, ref counts equal the number of owners, hashes agree."""
        counts = Counter(block for owned in owners for block in owned)
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == counts.get(block, 0), (
                f"block {block}: ref count {self.ref_counts[block]} but {counts.get(block, 0)} owners")
            assert (block in self.free_pool) == (self.ref_counts[block] == 0), f"block {block} pool state"
        for block_hash, block in self.cached.items():
            assert self.block_hash[block] == block_hash
        assert sum(h is not None for h in self.block_hash) == len(self.cached)
