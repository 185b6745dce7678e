"""The sliding-window layers' blocks: a pool of their own, from which each sequence holds only the blocks
its window still reaches, as vLLM's hybrid allocator keeps one block table per group of layers.

A sliding-window layer attends from position ``p`` to positions ``p - window + 1 .. p``. Once a sequence
has computed ``n`` tokens, every later query sits at ``n`` or beyond, so a block whose last position is
below ``n - window + 1`` is never read again: it goes back to the pool (findable by its prefix hash
until it is handed out again, like any free block). The sequence's table keeps a placeholder in its place
(block 0: those positions are masked, so any block may stand in), and remembers from which logical
block on it holds blocks of its own, so that each step looks only at the blocks it gives back.
The full-attention layers keep every block in the main pool (``kv/manager.py``), which alone bounds a
sequence's length; this pool needs only about a window's worth of blocks per running sequence.
"""

from __future__ import annotations

from mlx_infer.kv.block_pool import BlockHash, BlockPool

PLACEHOLDER = 0  # the table entry of a block given back (or never needed)


class WindowBlocks:
    def __init__(self, pool: BlockPool, window: int, block_size: int):
        self.pool = pool
        self.window = window
        self.block_size = block_size
        self.tables: dict[str, list[int]] = {}
        self._held_from: dict[str, int] = {}  # first logical block each sequence holds a block for

    def first_needed(self, num_computed: int) -> int:
        """The first logical block that a query at position ``num_computed`` or later may read."""
        return max(0, num_computed - self.window + 1) // self.block_size

    def held(self, seq_id: str) -> list[int]:
        """The blocks the sequence holds (a reference each)."""
        return self.tables.get(seq_id, [])[self._held_from.get(seq_id, 0) :]

    def cached(self, hashes: list[BlockHash], num_blocks: int) -> bool:
        """Whether the pool still holds every block a sequence resuming after ``num_blocks`` cached blocks
        (named by ``hashes``) reads."""
        first = self.first_needed(num_blocks * self.block_size)
        return all(self.pool.lookup(h) is not None for h in hashes[first:num_blocks])

    def attach_prefix(self, seq_id: str, hashes: list[BlockHash]) -> None:
        """Give a new sequence the cached blocks of its ``len(hashes)``-block prefix that its window still
        reaches (:meth:`cached` must hold)."""
        first = self.first_needed(len(hashes) * self.block_size)
        table = [PLACEHOLDER] * first
        for block_hash in hashes[first:]:
            block = self.pool.lookup(block_hash)
            self.pool.acquire(block)
            table.append(block)
        self.tables[seq_id] = table
        self._held_from[seq_id] = first

    def allocate(self, seq_id: str, num_computed: int, num_blocks: int) -> list[int] | None:
        """Give back the blocks the sequence's window has left behind at ``num_computed`` tokens, then
        cover its first ``num_blocks`` logical blocks; returns the blocks newly taken, or None (nothing
        taken) if the pool is short."""
        table = self.tables.setdefault(seq_id, [])
        start = self._held_from.get(seq_id, 0)
        first = min(self.first_needed(num_computed), num_blocks)
        if first > start:
            gone = table[start:first]
            self.pool.release(gone)
            table[start : start + len(gone)] = [PLACEHOLDER] * len(gone)
            table.extend([PLACEHOLDER] * (first - len(table)))  # blocks it never needed
            self._held_from[seq_id] = first
        missing = num_blocks - len(table)
        blocks = self.pool.allocate(missing) if missing > 0 else []
        if blocks is None:
            return None
        table.extend(blocks)
        return blocks

    def register(self, seq_id: str, index: int, block_hash: BlockHash) -> None:
        """Make the sequence's logical block ``index`` findable, if the sequence still holds it."""
        table = self.tables.get(seq_id, [])
        if self._held_from.get(seq_id, 0) <= index < len(table):
            self.pool.register(table[index], block_hash)

    def trim(self, seq_id: str, num_blocks: int) -> None:
        """Keep only the first ``num_blocks`` logical blocks (rejected speculative tokens' blocks go)."""
        table = self.tables.get(seq_id, [])
        start = self._held_from.get(seq_id, 0)
        self.pool.release(table[max(start, num_blocks) :])
        del table[num_blocks:]
        self._held_from[seq_id] = min(start, len(table))

    def free(self, seq_id: str) -> None:
        self.pool.release(self.held(seq_id))
        self.tables.pop(seq_id, None)
        self._held_from.pop(seq_id, None)
