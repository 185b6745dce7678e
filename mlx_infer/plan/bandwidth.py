"""Memory read bandwidth, the bound on decode: Apple's published figure per chip, else measured once.

Decode reads every weight (and the context's K/V) once per step, so tokens per second cannot exceed
bandwidth / bytes per step. On an Apple chip the published unified-memory bandwidth is that ceiling;
binned chips sold at two bandwidths (M3 Max, M4 Max) get the lower one, as the device name does not
tell them apart. Elsewhere (Linux) a single-threaded read of a 256 MiB buffer is timed, the best of a
few passes, and cached per CPU in ``$MLX_INFER_CACHE/plan/bandwidth.json`` so that ``plan`` stays instant.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

# GB/s (10^9 bytes), Apple's specifications.
APPLE_GBPS = {
    "M1": 68.25, "M1 Pro": 200.0, "M1 Max": 400.0, "M1 Ultra": 800.0,
    "M2": 100.0, "M2 Pro": 200.0, "M2 Max": 400.0, "M2 Ultra": 800.0,
    "M3": 100.0, "M3 Pro": 150.0, "M3 Max": 300.0, "M3 Ultra": 819.0,
    "M4": 120.0, "M4 Pro": 273.0, "M4 Max": 410.0,
    "M5": 153.0,
}  # fmt: skip
_BUFFER_BYTES = 256 * 2**20
_PASSES = 3


def memory_bandwidth() -> tuple[float, str]:
    """(bytes per second, where the figure comes from)."""
    if mx.metal.is_available():
        name = str(mx.metal.device_info().get("device_name", ""))
        chip = name.removeprefix("Apple ").strip()
        if chip in APPLE_GBPS:
            return APPLE_GBPS[chip] * 1e9, f"{name} specification"
    key = _cpu_name()
    cache = _cache_file()
    known = _read_cache(cache)
    if key not in known:
        known[key] = _measure()
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps(known, indent=1))
    return known[key], f"measured on one thread, cached in {cache}"


def _measure() -> float:
    buffer = np.ones(_BUFFER_BYTES // 8)  # written once, so every page is resident before timing
    best = float("inf")
    for _ in range(_PASSES):
        start = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - start)
    return buffer.nbytes / best


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cache_file() -> Path:
    from mlx_infer.model_store import mlx_infer_cache

    return mlx_infer_cache() / "plan" / "bandwidth.json"


def _read_cache(path: Path) -> dict[str, float]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return (
        {k: float(v) for k, v in data.items() if isinstance(v, (int, float))}
        if isinstance(data, dict)
        else {}
    )
