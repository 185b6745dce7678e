"""The machine's memory read bandwidth and the decode bound it sets.

Decoding one token reads every weight once (and the KV cache of each sequence), so on a CPU the
token rate cannot beat ``bandwidth / bytes read per step``: that is the physical limit each decode
figure is printed next to.
"""

from __future__ import annotations

import time

import numpy as np

BUFFER_BYTES = 512 * 2**20  # far larger than any last-level cache, so every read comes from DRAM


class BandwidthProbe:
    """Single-threaded read bandwidth in bytes/s, measured as often as asked on one 512 MiB buffer.

    Each measurement is the best of ``repeats`` full reductions of the buffer with each of two NumPy
    reductions (SIMD ``max`` and pairwise ``sum``), because either can be compute-bound on some CPUs;
    neither uses more than one thread. On a shared VM whose speed drifts by tens of percent within
    minutes, a bound taken once at the start describes the machine of that moment only: a benchmark
    measures again right before each sample, and each sample is set against its own bound.
    """

    def __init__(self, repeats: int = 3) -> None:
        self.repeats = repeats
        self._buf = np.ones(BUFFER_BYTES // 4, dtype=np.float32)
        for reduce in (np.max, np.sum):
            reduce(self._buf)  # fault the pages in before any timing

    def __call__(self) -> float:
        best = float("inf")
        for reduce in (np.max, np.sum):
            for _ in range(self.repeats):
                start = time.perf_counter()
                reduce(self._buf)
                best = min(best, time.perf_counter() - start)
        return self._buf.nbytes / best


def decode_bound(
    bandwidth: float, weight_bytes: int, kv_bytes_per_token: int, batch: int, context: float
) -> float:
    """Tokens/s when a decode step of ``batch`` sequences only waits for memory.

    A step reads the weights once for the whole batch and each sequence's KV cache
    (``context`` tokens on average), and yields ``batch`` tokens.
    """
    step_bytes = weight_bytes + batch * context * kv_bytes_per_token
    return batch * bandwidth / step_bytes
