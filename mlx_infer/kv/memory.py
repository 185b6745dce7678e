"""How much memory the KV pool may take."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import mlx.core as mx

from mlx_infer.errors import InvalidRequest
from mlx_infer.kv.block_pool import BlockPool
from mlx_infer.kv.pages import pages_droppable

# Without --kv-memory the pool takes this fraction of what is left for it: a server on a Mac
# should leave room for the OS and other apps.
DEFAULT_FRACTION = 0.25
MAX_DEFAULT_BYTES = 8 * 2**30


def device_memory_bytes() -> int:
    """The device's recommended working set on Metal; physical RAM on the CPU backend."""
    if mx.metal.is_available():
        return int(mx.metal.device_info()["max_recommended_working_set_size"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_budget_bytes(kv_memory_gib: float | None) -> int:
    """Bytes for the KV pool: ``kv_memory_gib`` if given, else a share of the memory budget (the device's,
    or ``$MLX_INFER_MEMORY_BUDGET``) minus the weights already loaded (``mx.get_active_memory``), capped
    so a small model does not grab GBs."""
    from mlx_infer.plan.planner import human_bytes, memory_budget  # the planner reads this module

    budget, where = memory_budget()
    loaded = mx.get_active_memory()
    left = max(budget - loaded, 0)
    if kv_memory_gib is None:
        return int(min(left * DEFAULT_FRACTION, MAX_DEFAULT_BYTES))
    if not math.isfinite(kv_memory_gib) or kv_memory_gib <= 0:
        raise InvalidRequest(f"--kv-memory must be a positive number of GiB, not {kv_memory_gib}")
    # The pool grows into its budget as load comes: one past what the machine has left would be found out
    # by the OS killing the process (or swapping), long after the start.
    if kv_memory_gib * 2**30 > left:
        raise InvalidRequest(
            f"--kv-memory {kv_memory_gib:g} GiB is more than this machine has left for it: "
            f"{human_bytes(left)} ({where} {human_bytes(budget)} less {human_bytes(loaded)} loaded)"
        )
    return int(kv_memory_gib * 2**30)


@dataclass(frozen=True)
class PoolMemory:
    """The KV pool's memory in bytes: what it may take, what its reserved chunks span (at most what is
    resident, see kv/pages.py) and what the blocks referenced by sequences hold."""

    budget: int
    reserved: int
    used: int

    def __add__(self, other: PoolMemory) -> PoolMemory:
        return PoolMemory(self.budget + other.budget, self.reserved + other.reserved, self.used + other.used)

    @classmethod
    def of(cls, pool: BlockPool, block_bytes: int) -> PoolMemory:
        return cls(
            pool.num_blocks * block_bytes, pool.num_reserved * block_bytes, pool.num_used * block_bytes
        )


def describe_pool(
    pool: BlockPool, block_size: int, block_bytes: int, dtype: str, idle_release: float
) -> str:
    """The startup line: the KV dtype, the budget and the tokens that fit it, what is reserved now, how
    the pool grows and when it shrinks."""
    mib = 2**20
    memory = PoolMemory.of(pool, block_bytes)
    chunk = pool.chunk_blocks
    line = (
        f"KV cache: {dtype}, {block_bytes // block_size} B a token; budget {memory.budget / mib:.1f} MiB "
        f"= {pool.num_blocks} blocks of {block_size} tokens = {pool.num_blocks * block_size} tokens; "
        f"reserved {memory.reserved / mib:.1f} MiB, "
        f"grows in chunks of {chunk * block_size} tokens ({chunk * block_bytes / mib:.1f} MiB), "
        f"memory given back after {idle_release:g} s idle"
    )
    if not pages_droppable():
        line += "; resident at once (pages cannot be dropped on this backend)"
    return line
