"""The machine's memory read bandwidth and the decode bound it sets.

Decoding one token reads every weight once (and the KV cache of each sequence), so on a CPU the
token rate cannot beat ``bandwidth / bytes read per step``: that is the physical limit each decode
figure is printed next to.
"""

from __future__ import annotations

import time

import numpy as np

BUFFER_BYTES = 512 * 2**20  # far larger than any last-level cache, so every read comes from DRAM


def read_bandwidth(repeats: int = 5) -> float:
    """Single-threaded read bandwidth in bytes/s: best of ``repeats`` full reductions of a 512 MiB buffer.

    Two NumPy reductions (SIMD ``max`` and pairwise ``sum``) and the faster one wins, because either
    can be compute-bound on some CPUs; neither uses more than one thread.
    """
    buf = np.ones(BUFFER_BYTES // 4, dtype=np.float32)
    best = float("inf")
    for reduce in (np.max, np.sum):
        reduce(buf)  # fault the pages in before timing
        for _ in range(repeats):
            start = time.perf_counter()
            reduce(buf)
            best = min(best, time.perf_counter() - start)
    return buf.nbytes / best


def decode_bound(
    bandwidth: float, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float
) -> float:
    """Tokens/s when a decode step of ``batch`` sequences only waits for memory.

    A step reads the weights once for the whole batch and each sequence's KV cache
    (``context`` tokens on average), and yields ``batch`` tokens.
    """
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    return batch * bandwidth / step_bytes
