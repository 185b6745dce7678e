"""Per-sequence recurrent state of a layer that keeps no K/V (linear attention, e.g. Gated DeltaNet).

Such a layer declares a :class:`StateSpec` (one fixed shape per array a sequence keeps, whatever its
length) and receives a :class:`LayerState`: one MLX array per spec shape with a leading *slot* axis.
The KV manager's slot pool (``kv/state_slots.py``) gives each running sequence a slot; the step's
``BatchMetadata.state_slots`` says which row each sequence reads and writes, so layers never learn
about requests or paging.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import mlx.core as mx

if TYPE_CHECKING:  # base imports this module (new_cache builds LayerState)
    from mlx_infer.models.base import BatchMetadata


@dataclass(frozen=True)
class StateSpec:
    """What one sequence keeps in a recurrent layer: arrays of these shapes, of ``dtype``."""

    shapes: tuple[tuple[int, ...], ...]
    dtype: mx.Dtype = mx.float32

    # A layer of kv_layout() that keeps a state keeps no K/V pool (KVSpec's counterpart).
    owns_pool = False

    def bytes_per_slot(self) -> int:
        return sum(math.prod(s) for s in self.shapes) * self.dtype.size


class LayerState:
    """The state arrays of one recurrent layer, ``[num_slots, *shape]`` each."""

    def __init__(self, num_slots: int, spec: StateSpec):
        self.spec = spec
        self.arrays = [mx.zeros((num_slots, *shape), dtype=spec.dtype) for shape in spec.shapes]

    @property
    def num_slots(self) -> int:
        return self.arrays[0].shape[0]

    def read(self, meta: BatchMetadata) -> list[mx.array]:
        """Each sequence's rows, ``[B, *shape]`` per array; zeros for a sequence that starts at position
        0 this step (a new request, or one recomputed after preemption), whatever its slot held."""
        slots = meta.state_slots
        continuing = (meta.context_lens > mx.array(meta.query_lens, dtype=mx.int32)).astype(self.spec.dtype)
        rows = []
        for arr in self.arrays:
            r = arr[slots]
            rows.append(r * continuing.reshape(-1, *([1] * (r.ndim - 1))))
        return rows

    def write(self, meta: BatchMetadata, values: list[mx.array]) -> None:
        """Scatter each sequence's new rows into its slot. Like ``LayerKV.write``, dropping the old
        references first lets the scatter reuse (donate) the arrays' buffers instead of copying them."""
        arrays, self.arrays = self.arrays, []
        for i, v in enumerate(values):
            arr = arrays[i]
            arrays[i] = None  # type: ignore[call-overload]
            arr[meta.state_slots] = v.astype(arr.dtype)
            self.arrays.append(arr)

    def state(self) -> list[mx.array]:
        return list(self.arrays)
