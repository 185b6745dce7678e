"""Per-sequence recurrent state of a layer that keeps no K/V (linear attention, e.g. Gated DeltaNet).

Such a layer declares a :class:`StateSpec` (one fixed shape per array a sequence keeps, whatever its
length) and receives a :class:`LayerState`: one MLX array per spec shape with a leading *slot* axis.
The KV manager's slot pool (``kv/state_slots.py``) gives each running sequence a slot; the step's
``BatchMetadata.state_slots`` says which row each sequence reads and writes, so layers never learn
about requests or paging.

A slot holds whatever its previous sequence left: a sequence that starts at position 0 this step (a new
request, or one recomputed after preemption) must start from zeros, which :func:`continuing` tells the
layer (it folds the zeroing into its first decay, at no extra pass over the state).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

from mlx_infer import cpu_kernels

if TYPE_CHECKING:
    from mlx_infer.interface.batch import BatchMetadata


@dataclass(frozen=True)
class StateSpec:
    """What one sequence keeps in a recurrent layer: arrays of these shapes, of ``dtype``."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: mx.Dtype = mx.float32

    # A layer of kv_layout() that keeps a state keeps no K/V pool and reads no other layer's (KVSpec's
    # counterparts).
    owns_pool = False
    source = None

    def bytes_per_slot(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * self.dtype.size


class LayerState:
    """The state arrays of one recurrent layer.

    Each is stored as ``[num_slots, 1, size]`` (a slot's state one contiguous row): the layout the native
    CPU KV write takes, so a step's rows are copied into their slots in place, as K/V rows are into a
    pool, instead of through MLX's generic scatter.
    """

    def __init__(self, num_slots: int, spec: StateSpec):
        self.spec = spec
        self.arrays = [mx.zeros((num_slots, 1, math.prod(shape)), dtype=spec.dtype) for shape in spec.shapes]

    @property
    def num_slots(self) -> int:
        return self.arrays[0].shape[0]

    def read(self, meta: BatchMetadata, index: int) -> mx.array:
        """Each sequence's rows of array ``index`` as they are in its slot, ``[B, *shape]`` (see
        :func:`continuing` for the sequences that must start from zeros)."""
        return self.arrays[index][meta.state_slots].reshape(-1, *self.spec.shapes[index])

    def write(self, meta: BatchMetadata, values: list[mx.array]) -> None:
        """Copy each sequence's new rows into its slot: ``values[i]`` is ``[B, *shape]``, or ``[B, W]``
        rows whose first ``size`` values are the state."""
        for i, v in enumerate(values):
            self.put(i, meta.state_slots, v)

    def put(self, index: int, slots: mx.array, rows: mx.array) -> None:
        """Rows (``[n, ...]``, the state first) into ``slots`` (``[n]``) of array ``index``. Like
        ``LayerKV.write``, dropping the old reference first lets the write reuse (donate) the array's
        buffer instead of copying it, and the native write reuses it always (the engine's memory)."""
        arr = self.detach(index)
        rows = rows.reshape(rows.shape[0], -1)
        native = cpu_kernels.kv_write(arr, rows, slots, in_place=True)
        if native is None:
            arr[slots] = rows[:, None, : arr.shape[-1]].astype(arr.dtype)
            native = arr
        self.attach(index, native)

    def detach(self, index: int) -> mx.array:
        """Array ``index``, no longer referenced here (an op may then update it in place); give the
        result back with :meth:`attach`."""
        arr = self.arrays[index]
        self.arrays[index] = None  # type: ignore[call-overload]
        return arr

    def attach(self, index: int, arr: mx.array) -> None:
        self.arrays[index] = arr

    def save(self, slot: int) -> list[mx.array]:
        """Copies of one slot's rows (a gather, so later in-place writes to the slot leave them alone)."""
        index = mx.array([slot], dtype=mx.int32)
        return [mx.take(arr, index, axis=0) for arr in self.arrays]

    def state(self) -> list[mx.array]:
        return list(self.arrays)


def continuing(meta: BatchMetadata) -> mx.array:
    """``[B]`` float32: 1 for a sequence that continues from its slot's state, 0 for one that starts at
    position 0 this step."""
    started = meta.context_lens > mx.array(meta.query_lens, dtype=mx.int32)
    return started.astype(mx.float32)
