"""The slot pool of per-sequence recurrent states (hybrid models' linear-attention layers).

A recurrent layer keeps a fixed-size state per sequence instead of K/V per token (``interface/state.py``):
every such layer has one state array per kind with ``num_slots`` rows, and a running sequence owns the
same row (its slot) in all of them. A sequence takes a slot when the KV manager first allocates for it
and gives it back when it is freed (finished, aborted or preempted). A recomputed sequence restarts
from zeros whichever slot it gets: layers zero the state of a sequence that starts at position 0.
"""

from __future__ import annotations

from collections import OrderedDict

import mlx.core as mx

from mlx_infer.kv.block_pool import BlockHash


class StateSlotPool:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._owner: dict[str, int] = {}

    def acquire(self, seq_id: str) -> bool:
        """Give ``seq_id`` a slot unless it has one; False if none is free."""
        if seq_id in self._owner:
            return True
        if not self._free:
            return False
        self._owner[seq_id] = self._free.pop()
        return True

    def slot(self, seq_id: str) -> int:
        return self._owner[seq_id]

    def holds(self, seq_id: str) -> bool:
        return seq_id in self._owner

    def release(self, seq_id: str) -> None:
        slot = self._owner.pop(seq_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def owners(self) -> dict[str, int]:
        return dict(self._owner)


class StateCheckpoints:
    """Recurrent states saved where a block ends, keyed by that block's prefix hash, so a later prompt with
    the same prefix can start from the state instead of from zero (prefix caching for hybrid models).

    Each entry is one sequence's rows of every state array (a few MB for a large model), so there are at
    most ``capacity`` of them, least recently used dropped first; the engine budgets them beside the slots.
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._entries: OrderedDict[BlockHash, list[mx.array]] = OrderedDict()

    def __contains__(self, block_hash: BlockHash) -> bool:
        return block_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, block_hash: BlockHash) -> list[mx.array]:
        self._entries.move_to_end(block_hash)
        return self._entries[block_hash]

    def put(self, block_hash: BlockHash, rows: list[mx.array]) -> None:
        self._entries[block_hash] = rows
        self._entries.move_to_end(block_hash)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def clear(self) -> None:
        self._entries.clear()
