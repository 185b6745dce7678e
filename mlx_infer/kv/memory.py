"""How much memory the KV pool may take."""

from __future__ import annotations

import os

import mlx.core as mx

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
    """Bytes for the KV pool: ``kv_memory_gib`` if given, else a share of device memory minus the
    weights already loaded (``mx.get_active_memory``), capped so a small model does not grab GBs."""
    if kv_memory_gib is not None:
        if kv_memory_gib <= 0:
            raise ValueError("--kv-memory must be positive")
        return int(kv_memory_gib * 2**30)
    free = max(device_memory_bytes() - mx.get_active_memory(), 0)
    return int(min(free * DEFAULT_FRACTION, MAX_DEFAULT_BYTES))
