"""The quantized weights the native CPU kernels stream, moved onto transparent huge pages (Linux).

A decode step reads every weight once, and from 4 KiB pages each 4 KiB costs a TLB miss and stops the
hardware prefetcher at its edge: on the 2-vCPU Zen 4 VM a cold 8-bit 49152 x 576 head read 16.3 GB/s
from 4 KiB pages and 20.1 GB/s from 2 MiB ones, and SmolLM2's batch-1 decode step took 0.88-0.94 of its
time with its weights on huge pages (two engines in one process, steps alternating; batch 16, bound by
arithmetic, 0.99-1.03). Linux
gives anonymous memory huge pages only where they were asked for (``madvise``) when its THP mode is
``madvise``, a common default, and MLX's buffers do not ask; one layer's arrays (0.2-1 MB for SmolLM2)
could not fill a 2 MiB page alone anyway.

So, once the projections are fused (models/fused.py) and before the native blocks bind the arrays
(models/native_block.py), the arrays of every quantized layer are copied, in model order, into shared
buffers of up to :data:`PACK_BYTES` advised for huge pages before their first touch
(``cpu_kernels.pack_on_huge_pages``), and the layers' arrays become views into them, as fused
projections' already are into their fused arrays. The values, shapes, dtypes and parameter names stay
the same (saving and ``parameters()`` see nothing new); memory grows by one buffer at most while it
happens (:data:`PACK_BYTES`, or one layer's arrays where they are larger).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.metal_kernels.layers import KernelQuantizedEmbedding, KernelQuantizedLinear
from mlx_infer.models.fused import FusedQuantizedLinear

log = logging.getLogger(__name__)

# The most a buffer holds unless one layer's arrays alone are larger (a head): the memory the move adds
# while it runs, as the arrays it copies are freed only once their views are in place. Smaller buffers
# lose more of their ends to 4 KiB pages (a buffer's first and last 2 MiB windows are partial).
PACK_BYTES = 32 << 20
# A buffer is one MLX array, whose dimensions are int32: a layer's arrays beyond that stay where they are.
_MOST_BYTES = 2**31 - 1
_NAMES = ("weight", "scales", "biases", "bias")


@dataclass
class _Holder:
    """Arrays that move together, and how to put their views in their place."""

    arrays: dict[str, mx.array]
    place: Callable[[dict[str, mx.array]], None]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())


def move_to_huge_pages(model: nn.Module) -> int:
    """Move ``model``'s quantized weights onto huge pages (see the module docstring); returns the bytes
    that landed on them (0 where nothing was moved: not Linux, no native kernels, THP off)."""
    if sys.platform != "linux" or not cpu_kernels.applies() or not _thp_enabled():
        return 0
    batches: list[list[_Holder]] = [[]]
    for holder in _holders(model):
        if holder.nbytes > _MOST_BYTES:
            continue
        if batches[-1] and sum(h.nbytes for h in batches[-1]) + holder.nbytes > PACK_BYTES:
            batches.append([])
        batches[-1].append(holder)
    on_huge = 0
    for batch in batches:
        try:
            on_huge += _pack(batch) if batch else 0
        except RuntimeError as e:  # no memory for one more buffer: the rest stays where it is, as it was
            log.warning("weights left on 4 KiB pages from here (%s)", e)
            break
    return on_huge


def _thp_enabled() -> bool:
    """Whether this kernel gives huge pages to memory that asks (THP ``always`` or ``madvise``)."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def _holders(model: nn.Module) -> list[_Holder]:
    """The quantized layers' arrays in model order: a fused group's once (its members' are views into
    them), each other kernel-computed layer's (a tied head's embedding table too)."""
    modules = [m for _, m in reversed(model.named_modules())]  # MLX lists them last first
    members: dict[int, list[FusedQuantizedLinear]] = {}
    for module in modules:
        if isinstance(module, FusedQuantizedLinear):
            members.setdefault(id(module._fused), []).append(module)
    holders: list[_Holder] = []
    for module in modules:
        if isinstance(module, FusedQuantizedLinear):
            group = members.pop(id(module._fused), None)
            if group is not None:  # the group's first member
                fused = module._fused
                holders.append(_Holder(dict(fused.params), _fused_placer(fused, group)))
        elif type(module) in (KernelQuantizedLinear, KernelQuantizedEmbedding):
            arrays = {n: module[n] for n in _NAMES if n in module}
            holders.append(_Holder(arrays, _layer_placer(module)))
    return holders


def _fused_placer(fused, members: list[FusedQuantizedLinear]) -> Callable[[dict[str, mx.array]], None]:
    def place(views: dict[str, mx.array]) -> None:
        fused.params = views
        for member in members:
            member._join(fused, member._index)  # its own views, now into the moved arrays

    return place


def _layer_placer(layer: nn.Module) -> Callable[[dict[str, mx.array]], None]:
    def place(views: dict[str, mx.array]) -> None:
        for name, view in views.items():
            layer[name] = view

    return place


def _pack(holders: list[_Holder]) -> int:
    """Copy the holders' arrays into one buffer on huge pages and put views of it in their place;
    returns the bytes of the buffer on huge pages."""
    arrays = [a for h in holders for a in h.arrays.values()]
    buffer, offsets = cpu_kernels.pack_on_huge_pages(arrays)
    views, at = [], iter(offsets)
    for holder in holders:
        moved = {}
        for name, a in holder.arrays.items():
            start = next(at)
            moved[name] = buffer[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
        views.append(moved)
    mx.eval(views)
    del arrays
    for holder, moved in zip(holders, views, strict=True):
        holder.place(moved)
        holder.arrays = {}  # the copies are in place: the arrays they were made from go now
    return cpu_kernels.huge_page_bytes(buffer)
