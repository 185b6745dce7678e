"""The block pool: free list, reference counts and the prefix cache over full blocks.

A free block may still hold a cached prefix: it stays findable by its hash until it is
handed out again. Free blocks leave in LRU order (least recently released first), so cached
prefixes are evicted only when unreferenced, and the oldest first.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def hash_block(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """Hash of a full block: it names the whole prefix ending with this block, not just its tokens."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        self.queries = 0  # prefix-cache lookups (in blocks) and hits, for metrics
        self.hits = 0

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out (cached-but-unreferenced ones included)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with one reference each, or None (nothing taken) if too few are free."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to a (cached) block, taking it off the free list if it was there."""
        if self.ref_counts[block] == 0:
            del self._free[block]
        self.ref_counts[block] += 1

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free (and stay cached).

        Released in reverse so a sequence's tail blocks (least likely to be shared) are evicted first.
        """
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Make a full, computed (or being computed this step) block findable by its prefix hash."""
        if self.block_hashes[block] is not None or block_hash in self._cached:
            return
        self.block_hashes[block] = block_hash
        self._cached[block_hash] = block

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block] = None

    def reset_prefix_cache(self) -> None:
        for block in list(self._free):
            self._evict(block)
