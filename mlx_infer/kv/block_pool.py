"""The block pool: free list, reference counts and the prefix cache over full blocks.

A free block may still hold a cached prefix: it stays findable by its hash until it is
handed out again. Free blocks holding no prefix are handed out first; then, only when the budget allows
no more, cached ones in LRU order (least recently released first), so cached prefixes are evicted only
when unreferenced, the oldest first, and only once the budget is used up (as a pool allocated whole).

The blocks are grouped in chunks of consecutive ids, and only *reserved* chunks (always the lowest
ones) hand out blocks: the pool's memory follows what the scheduler needs. A chunk is reserved when the
free blocks of the reserved ones that hold no prefix run out, and the top chunks are unreserved again
(``release_idle_chunks``) once none of their blocks is referenced.
Idle, the free blocks of the chunks that stay reserved are forgotten too
(``forget_free_blocks``), so their memory can go back as well. ``num_free`` counts every block
the budget still allows, so callers see the budget, not the reservation: an allocation fails
(and the scheduler preempts) only when the budget is exhausted.
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
    def __init__(self, num_blocks: int, chunk_blocks: int | None = None, min_chunks: int = 1):
        """``chunk_blocks``: blocks per chunk (None: one chunk, the whole pool reserved at once);
        ``min_chunks``: chunks reserved from the start and never released."""
        if num_blocks < 1:
            raise ValueError("the KV pool needs at least one block")
        if chunk_blocks is not None and chunk_blocks < 1:
            raise ValueError("a KV chunk needs at least one block")
        self.num_blocks = num_blocks
        self.chunk_blocks = min(chunk_blocks or num_blocks, num_blocks)
        self.num_chunks = -(-num_blocks // self.chunk_blocks)
        self.min_chunks = max(1, min(min_chunks, self.num_chunks))
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[BlockHash | None] = [None] * num_blocks
        # Free blocks of the reserved chunks: those holding no prefix, and those holding one (LRU first).
        self._clean: OrderedDict[int, None] = OrderedDict()
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self.num_reserved_chunks = 0
        self.allocated_since_release = False  # blocks handed out since forget_free_blocks last ran
        for _ in range(self.min_chunks):
            self._reserve_chunk()
        self._cached: dict[BlockHash, int] = {}
        self.queries = 0  # prefix-cache lookups (in blocks) and hits, for metrics
        self.hits = 0

    def chunk(self, index: int) -> range:
        """The block ids of chunk ``index`` (the last chunk may be shorter)."""
        return range(index * self.chunk_blocks, min((index + 1) * self.chunk_blocks, self.num_blocks))

    @property
    def num_reserved(self) -> int:
        """Blocks of the reserved chunks: the pool's current size."""
        return min(self.num_reserved_chunks * self.chunk_blocks, self.num_blocks)

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out within the budget (cached-but-unreferenced ones and those of
        chunks not reserved yet included)."""
        return len(self._clean) + len(self._cached_free) + self.num_blocks - self.num_reserved

    @property
    def num_used(self) -> int:
        """Blocks referenced by sequences."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def allocate(self, count: int) -> list[int] | None:
        """``count`` fresh blocks with one reference each, or None (nothing taken) if too few are free."""
        if count > self.num_free:
            return None
        # The pool grows within its budget before a cached prefix is given up.
        while len(self._clean) < count and self.num_reserved_chunks < self.num_chunks:
            self._reserve_chunk()
        self.allocated_since_release = True
        blocks = []
        for _ in range(count):
            free = self._clean if self._clean else self._cached_free
            block, _ = free.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            blocks.append(block)
        return blocks

    def acquire(self, block: int) -> None:
        """Add a reference to a (cached) block, taking it off the free list if it was there."""
        if self.ref_counts[block] == 0:
            self._unfree(block)
        self.ref_counts[block] += 1

    def _unfree(self, block: int) -> None:
        """Take a free block off whichever free list holds it."""
        del (self._cached_free if block in self._cached_free else self._clean)[block]

    def release(self, blocks: Sequence[int]) -> None:
        """Drop one reference from each block; blocks reaching zero become free (and stay cached).

        Released in reverse so a sequence's tail blocks (least likely to be shared) are evicted first.
        """
        for block in reversed(blocks):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] < 0:
                raise RuntimeError(f"block {block} released more often than acquired")
            if self.ref_counts[block] == 0:
                (self._clean if self.block_hashes[block] is None else self._cached_free)[block] = None

    def register(self, block: int, block_hash: BlockHash) -> None:
        """Make a full, computed (or being computed this step) block findable by its prefix hash."""
        if self.block_hashes[block] is not None or block_hash in self._cached:
            return
        self.block_hashes[block] = block_hash
        self._cached[block_hash] = block
        if block in self._clean:  # registered while free (unreferenced): now a cached one
            del self._clean[block]
            self._cached_free[block] = None

    def _evict(self, block: int) -> None:
        block_hash = self.block_hashes[block]
        if block_hash is not None:
            del self._cached[block_hash]
            self.block_hashes[block] = None

    def _reserve_chunk(self) -> None:
        """Reserve the next chunk; its blocks hold no prefix."""
        for block in self.chunk(self.num_reserved_chunks):
            self._clean[block] = None
        self.num_reserved_chunks += 1

    def release_idle_chunks(self) -> list[range]:
        """Unreserve the top chunks above ``min_chunks`` while none of their blocks is referenced (their
        cached prefixes are forgotten); returns their block ranges, whose memory the caller gives back."""
        released = []
        while self.num_reserved_chunks > self.min_chunks:
            blocks = self.chunk(self.num_reserved_chunks - 1)
            if any(self.ref_counts[b] for b in blocks):
                break
            for block in blocks:
                self._evict(block)
                self._unfree(block)
            self.num_reserved_chunks -= 1
            released.append(blocks)
        return released

    def forget_free_blocks(self) -> list[range]:
        """Forget the cached prefixes of every free block of the reserved chunks; returns those blocks as
        runs of consecutive ids, whose memory the caller may give back (their contents are not needed)."""
        runs: list[range] = []
        self.reset_prefix_cache()
        for block in sorted(self._clean):
            if runs and runs[-1].stop == block:
                runs[-1] = range(runs[-1].start, block + 1)
            else:
                runs.append(range(block, block + 1))
        self.allocated_since_release = False
        return runs

    def reset_prefix_cache(self) -> None:
        """Forget the prefixes the free blocks hold (they become blocks holding none)."""
        for block in self._cached_free:
            self._evict(block)
            self._clean[block] = None
        self._cached_free.clear()
