"""Physical memory of the KV pools: allocated without staying resident, handed back per chunk.

Why a fresh server held 6 GB of zeros: ``mx.zeros`` is evaluated by writing every byte, and a page
once written stays resident, so the whole budget was resident before the first request. On Linux,
``madvise(MADV_DONTNEED)`` on private anonymous memory (what MLX's CPU allocator gets from malloc)
drops pages at once; they read back as zeros and take memory again only when written. So each
layer's K and V pool is allocated at the full budget (one MLX array each: kernels and block tables
are unchanged), its pages are dropped right away, and only the blocks the scheduler hands out become
resident, page by page, as their K/V is written. Growing copies nothing. Chunks the block pool
releases after an idle period are dropped the same way. A slot still reads either zeros or K/V
written earlier, as with a zeroed pool.

Where pages cannot be dropped this way (Metal or CUDA buffers, other systems) the pools stay resident
as allocated, and releasing a chunk only returns its blocks to the budget's bookkeeping.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
import sys
from collections.abc import Callable, Sequence

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer.interface.kv import LayerKV, new_cache
from mlx_infer.interface.state import LayerState

MADV_DONTNEED = 4  # Linux


@functools.cache
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise where dropping pages of MLX arrays is known to work: Linux, CPU memory."""
    cuda = getattr(mx, "cuda", None)
    if not sys.platform.startswith("linux") or mx.metal.is_available() or (cuda and cuda.is_available()):
        return None
    madvise = ctypes.CDLL(None, use_errno=True).madvise
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


def pages_droppable() -> bool:
    return _madvise() is not None


def drop_pages(array: mx.array, start: int, stop: int) -> int:
    """Give back the whole pages inside bytes [start, stop) of an evaluated, contiguous ``array``; the
    bytes read as zeros afterwards. Returns the bytes given back (0 where pages cannot be dropped)."""
    madvise = _madvise()
    if madvise is None or stop <= start:
        return 0
    # The address through a NumPy view of the buffer (no copy); the view is gone before this returns,
    # so the pool stays donatable (no second reference) for the next step's in-place KV write.
    base = np.asarray(array.view(mx.uint8) if array.dtype == mx.bfloat16 else array).ctypes.data
    page = mmap.PAGESIZE
    low = -(-(base + start) // page) * page
    high = (base + stop) // page * page
    if high <= low:
        return 0
    if madvise(low, high - low, MADV_DONTNEED) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"madvise: {os.strerror(err)}")
    return high - low


def allocate_pools(
    model: nn.Module,
    num_blocks: int,
    block_size: int,
    dtype: mx.Dtype,
    num_state_slots: int = 1,
    window_blocks: int | None = None,
) -> list[LayerKV | LayerState]:
    """Every layer's cache (``model.kv_layout()``) at ``num_blocks`` blocks (sliding-window layers:
    ``window_blocks`` of their own when given; recurrent layers: ``num_state_slots`` sequence states),
    each pool evaluated and dropped (where pages can be dropped) in turn, so that at most one layer's
    pools are ever resident here."""
    cache = new_cache(model, num_blocks, block_size, dtype, num_state_slots, window_blocks)
    for layer in owned(cache) + states(cache):
        mx.eval(layer.state())
        for pool in layer.state():
            drop_pages(pool, 0, pool.nbytes)
    return cache


def owned(cache: list[LayerKV | LayerState], windowed: bool | None = None) -> list[LayerKV]:
    """Each distinct K/V pool holder of ``cache`` once (layers sharing a source's pools hold none); with
    ``windowed``, only those of the sliding-window pool (True) or of the main one (False)."""
    layers = {id(layer): layer for layer in cache if isinstance(layer, LayerKV)}.values()
    return [layer for layer in layers if windowed is None or layer.windowed == windowed]


def states(cache: list[LayerKV | LayerState]) -> list[LayerState]:
    """The recurrent layers' state slots (not paged: a block range means nothing to them)."""
    return [layer for layer in cache if isinstance(layer, LayerState)]


def drop_blocks(cache: list[LayerKV | LayerState], blocks: Sequence[range], windowed: bool = False) -> int:
    """Give back the memory of block ranges in the main pool's layers (``windowed``: the sliding-window
    pool's), their K/V being no longer needed; returns the bytes given back."""
    layers = owned(cache, windowed)
    mx.eval([a for layer in layers for a in layer.state()])  # no step may still be writing them
    dropped = 0
    for layer in layers:
        for pool in layer.state():
            block_bytes = pool.nbytes // layer.num_blocks
            for r in blocks:
                dropped += drop_pages(pool, r.start * block_bytes, r.stop * block_bytes)
    return dropped
