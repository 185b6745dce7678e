"""Per-sequence KV bookkeeping on top of the block pool: block tables, prefix hits, slot allocation."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_infer.kv.block_pool import BlockHash, BlockPool, hash_block
from mlx_infer.kv.state_slots import StateCheckpoints, StateSlotPool
from mlx_infer.kv.window import WindowBlocks


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        chunk_blocks: int | None = None,
        min_chunks: int = 1,
        num_state_slots: int = 0,
        num_state_checkpoints: int = 0,
        window: int | None = None,
        window_blocks: int = 0,
    ):
        """``num_state_slots``: recurrent-state slots (hybrid models; 0: the model keeps no state);
        ``num_state_checkpoints``: how many saved states prefix caching may keep for them; ``window``:
        the sliding-window layers' window, whose blocks come from a pool of ``window_blocks`` of their
        own (``kv/window.py``; None: every layer uses the main pool's blocks)."""
        self.pool = BlockPool(num_blocks, chunk_blocks, min_chunks)
        self.window = (
            WindowBlocks(BlockPool(window_blocks, chunk_blocks, min_chunks), window, block_size)
            if window is not None
            else None
        )
        self.state_slots = StateSlotPool(num_state_slots) if num_state_slots else None
        # Hybrid models: a cached prefix is usable only up to a block whose end has a saved state.
        self.checkpoints = (
            StateCheckpoints(num_state_checkpoints)
            if num_state_slots and num_state_checkpoints and enable_prefix_caching
            else None
        )
        self._saved: dict[str, tuple[int, list]] = {}  # seq -> (blocks covered, state rows) not yet hashed
        self.restores: dict[str, list] = {}  # seq -> state rows to load into its slot before its next step
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}  # hashes of each sequence's full blocks so far

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int], reuse: bool = True) -> int:
        """Attach the longest cached prefix of ``token_ids`` to a sequence that has no blocks yet
        (none without ``reuse``: a sequence that wants every position's logits computes them all).

        Returns how many tokens are already computed. At least one token is always left to compute,
        since the step needs the logits of the last prompt token. The prefix ends where every kind of
        layer can resume: the sliding-window layers need the blocks their window reaches there, the
        recurrent layers of hybrid models a state saved at that block's end.
        """
        table = self.block_tables.setdefault(seq_id, [])
        if table or not self.enable_prefix_caching or not reuse:
            self._hashes.setdefault(seq_id, [])
            return 0
        hashes: list[BlockHash] = []
        bs = self.block_size
        for i in range((len(token_ids) - 1) // bs):
            block_hash = hash_block(hashes[-1] if hashes else None, token_ids[i * bs : (i + 1) * bs])
            self.pool.queries += 1
            if self.pool.lookup(block_hash) is None:
                break
            hashes.append(block_hash)
        while hashes and not self._resumable(hashes):
            hashes.pop()
        self.pool.hits += len(hashes)
        for block_hash in hashes:
            block = self.pool.lookup(block_hash)
            self.pool.acquire(block)
            table.append(block)
        self._hashes[seq_id] = hashes
        if self.window is not None:
            self.window.attach_prefix(seq_id, hashes)
        if self.checkpoints is not None and hashes:
            self.restores[seq_id] = self.checkpoints.get(hashes[-1])
        return len(table) * self.block_size

    def _resumable(self, hashes: list[BlockHash]) -> bool:
        """Whether a sequence can resume after the cached blocks ``hashes``."""
        if self.window is not None and not self.window.cached(hashes, len(hashes)):
            return False
        return self.checkpoints is None or hashes[-1] in self.checkpoints

    def forget_states(self) -> None:
        """Drop every saved state (idle release; pools reallocated after a failed step)."""
        if self.checkpoints is not None:
            self.checkpoints.clear()
            self._saved.clear()
            self.restores.clear()

    def save_state(self, seq_id: str, num_tokens: int, rows: list) -> None:
        """The sequence's state after its first ``num_tokens`` tokens (a block boundary): kept as a
        checkpoint under that block's hash once the block is registered (its last token may still be
        pending now)."""
        if self.checkpoints is not None:
            self._saved[seq_id] = (num_tokens // self.block_size, rows)
            self._checkpoint(seq_id)

    def _checkpoint(self, seq_id: str) -> None:
        saved = self._saved.get(seq_id)
        hashes = self._hashes.get(seq_id, [])
        if saved is not None and 0 < saved[0] <= len(hashes):
            self.checkpoints.put(hashes[saved[0] - 1], saved[1])
            del self._saved[seq_id]

    def allocate(
        self, seq_id: str, token_ids: Sequence[int], num_computed: int, num_new: int, register: bool = True
    ) -> bool:
        """Ensure blocks cover ``num_computed + num_new`` tokens; False (nothing taken) if the pool is short.

        With ``register``, full blocks whose tokens are known enter the prefix cache right away: their
        K/V is written before any attention reads it within the step, so a request scheduled later in
        the same step may already share them. Callers that may still undo this step's allocation
        (preemption) register afterwards with :meth:`register`.
        """
        table = self.block_tables.setdefault(seq_id, [])
        slots = self.state_slots
        new_slot = slots is not None and not slots.holds(seq_id)
        if new_slot and not slots.acquire(seq_id):
            return False
        total = num_computed + num_new
        needed = self.blocks_needed(total)
        blocks = self.pool.allocate(needed - len(table)) if needed > len(table) else []
        if blocks is not None and self.window is not None:
            if self.window.allocate(seq_id, num_computed, needed) is None:
                self.pool.release(blocks)
                blocks = None
        if blocks is None:
            if new_slot:
                slots.release(seq_id)
            return False
        table.extend(blocks)
        if register:
            self.register(seq_id, token_ids, total)
        return True

    def register(self, seq_id: str, token_ids: Sequence[int], num_tokens: int) -> None:
        """Enter the sequence's full blocks among its first ``num_tokens`` tokens into the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_tokens = min(num_tokens, len(token_ids))
        hashes = self._hashes.setdefault(seq_id, [])
        table = self.block_tables[seq_id]
        bs = self.block_size
        for i in range(len(hashes), num_tokens // bs):
            parent = hashes[-1] if hashes else None
            block_hash = hash_block(parent, token_ids[i * bs : (i + 1) * bs])
            hashes.append(block_hash)
            self.pool.register(table[i], block_hash)
            if self.window is not None:
                self.window.register(seq_id, i, block_hash)
        if self.checkpoints is not None:
            self._checkpoint(seq_id)

    def trim(self, seq_id: str, num_tokens: int) -> None:
        """Return the blocks past the first ``num_tokens`` tokens (K/V of rejected speculative tokens).

        Those blocks were never registered: registration only covers tokens the host knows to be the
        sequence's own, and they lie before ``num_tokens``."""
        table = self.block_tables.get(seq_id)
        if table is None:
            return
        keep = self.blocks_needed(num_tokens)
        if len(self._hashes.get(seq_id, [])) > keep:
            raise RuntimeError(f"trimming registered blocks of {seq_id}")
        self.pool.release(table[keep:])
        del table[keep:]
        if self.window is not None:
            self.window.trim(seq_id, keep)

    def free(self, seq_id: str) -> None:
        """Return a sequence's blocks (they stay in the prefix cache until reused) and its state slot."""
        if self.checkpoints is not None:
            self._checkpoint(seq_id)
            self._saved.pop(seq_id, None)
            self.restores.pop(seq_id, None)
        self.pool.release(self.block_tables.pop(seq_id, []))
        self._hashes.pop(seq_id, None)
        if self.window is not None:
            self.window.free(seq_id)
        if self.state_slots is not None:
            self.state_slots.release(seq_id)

    def pools(self) -> list[BlockPool]:
        """The main block pool, then the sliding-window layers' one if the model has it."""
        return [self.pool] + ([] if self.window is None else [self.window.pool])

    def window_table(self, seq_id: str) -> list[int] | None:
        """The sequence's blocks in the sliding-window layers' pool (None: the model has no such pool)."""
        return None if self.window is None else self.window.tables.get(seq_id, [])

    def state_slot(self, seq_id: str) -> int | None:
        """The sequence's recurrent-state slot (None for models without recurrent layers)."""
        return None if self.state_slots is None else self.state_slots.slot(seq_id)

    @property
    def num_state_slots(self) -> int:
        return 0 if self.state_slots is None else self.state_slots.num_slots

    @property
    def usage(self) -> float:
        return self.pool.num_used / self.pool.num_blocks

    def hit_rate(self) -> float:
        return self.pool.hits / self.pool.queries if self.pool.queries else 0.0
