"""Per-sequence KV bookkeeping on top of the block pool: block tables, prefix hits, slot allocation."""

from __future__ import annotations

from collections.abc import Sequence

from mlx_infer.kv.block_pool import BlockHash, BlockPool, hash_block
from mlx_infer.kv.state_slots import StateCheckpoints, StateSlotPool


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
    ):
        """``num_state_slots``: recurrent-state slots (hybrid models; 0: the model keeps no state);
        ``num_state_checkpoints``: how many saved states prefix caching may keep for them."""
        self.pool = BlockPool(num_blocks, chunk_blocks, min_chunks)
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

    def find_cached_prefix(self, seq_id: str, token_ids: Sequence[int]) -> int:
        """Attach the longest cached prefix of ``token_ids`` to a sequence that has no blocks yet.

        Returns how many tokens are already computed. At least one token is always left to compute,
        since the step needs the logits of the last prompt token.
        """
        table = self.block_tables.setdefault(seq_id, [])
        hashes = self._hashes.setdefault(seq_id, [])
        if table or not self.enable_prefix_caching:
            return 0
        max_blocks = (len(token_ids) - 1) // self.block_size
        parent: BlockHash | None = None
        for i in range(max_blocks):
            parent = hash_block(parent, token_ids[i * self.block_size : (i + 1) * self.block_size])
            block = self.pool.lookup(parent)
            self.pool.queries += 1
            if block is None:
                break
            self.pool.hits += 1
            self.pool.acquire(block)
            table.append(block)
            hashes.append(parent)
        if self.checkpoints is not None:
            self._cut_to_checkpoint(seq_id)
        return len(table) * self.block_size

    def _cut_to_checkpoint(self, seq_id: str) -> None:
        """Keep only the prefix blocks up to the last one with a saved state (hybrid models: the recurrent
        layers need their state there), and note that state for the runner to load."""
        table, hashes = self.block_tables[seq_id], self._hashes[seq_id]
        keep = next((i + 1 for i in range(len(hashes) - 1, -1, -1) if hashes[i] in self.checkpoints), 0)
        self.pool.hits -= len(table) - keep
        self.pool.release(table[keep:])
        del table[keep:], hashes[keep:]
        if keep:
            self.restores[seq_id] = self.checkpoints.get(hashes[-1])

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
        missing = self.blocks_needed(total) - len(table)
        if missing > 0:
            blocks = self.pool.allocate(missing)
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

    def free(self, seq_id: str) -> None:
        """Return a sequence's blocks (they stay in the prefix cache until reused) and its state slot."""
        if self.checkpoints is not None:
            self._checkpoint(seq_id)
            self._saved.pop(seq_id, None)
            self.restores.pop(seq_id, None)
        self.pool.release(self.block_tables.pop(seq_id, []))
        self._hashes.pop(seq_id, None)
        if self.state_slots is not None:
            self.state_slots.release(seq_id)

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
