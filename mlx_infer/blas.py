"""Bind an optimized BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links the reference (netlib) BLAS, which makes float32 matmuls 10-60x slower
than they need to be. ``libmlx.so`` resolves ``cblas_sgemm`` (and its LAPACK calls) through the
global symbol scope first, so a library loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported wins; no LD_PRELOAD or re-exec is needed. Python loads extensions with RTLD_NOW, so once
``mlx.core`` is imported its symbols are bound for good and loading a BLAS afterwards does nothing.

``setup()`` runs at the top of ``mlx_infer/__init__.py``. Choice, in order:
``MLX_INFER_BLAS=off`` (keep the reference BLAS), ``MLX_INFER_BLAS=/path/to/lib.so``, PyPI's ``mkl``
(``libmkl_rt.so.*`` in ``sys.prefix/lib``, installable without root), Debian's OpenBLAS.
Nothing is done off Linux: macOS builds of MLX use Accelerate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "MLX_INFER_BLAS"

# The CBLAS entry points libmlx.so imports; a library lacking one of them would leave MLX half bound.
REQUIRED_SYMBOLS = ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm")

OPENBLAS_PATHS = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
)

# MKL's defaults on a small VM: its OpenMP threads spin for 200 ms after each call, stealing the
# core MLX's own CPU stream runs on. Users can override any of these in the environment.
MKL_ENV_DEFAULTS = {"KMP_BLOCKTIME": "0"}

logger = logging.getLogger("mlx_infer")

_active = "not set up"


def active() -> str:
    """A one-line description of the BLAS MLX's CPU backend uses in this process."""
    return _active


def setup() -> str:
    """Choose and bind the BLAS once, before ``mlx.core`` is imported; returns ``active()``."""
    global _active
    if _active != "not set up":
        return _active
    _active = _choose()
    logger.info("BLAS: %s", _active)
    return _active


def _choose() -> str:
    if not sys.platform.startswith("linux"):
        return f"the platform's own BLAS (Accelerate on macOS; {ENV_VAR} applies to Linux only)"
    requested = os.environ.get(ENV_VAR, "").strip()
    if requested.lower() == "off":
        return f"reference BLAS ({ENV_VAR}=off)"
    if "mlx.core" in sys.modules:
        return "reference BLAS (mlx.core was imported before mlx_infer, too late to bind an optimized BLAS)"
    if requested:
        error = _bind(requested)
        if error is None:
            return f"{_describe(requested)} ({requested})"
        logger.warning("%s=%s: %s; using MLX's reference BLAS", ENV_VAR, requested, error)
        return f"reference BLAS ({ENV_VAR} path unusable: {error})"
    for path in _candidates():
        if _bind(path) is None:
            return f"{_describe(path)} ({path})"
    return "reference BLAS (no optimized BLAS found; `pip install mkl` to speed up float32 matmuls)"


def _candidates() -> Iterator[str]:
    """Paths to try, best first; lazy because ``find_library`` spawns ``ldconfig``."""
    lib = Path(sys.prefix) / "lib"
    # Highest soname version first: libmkl_rt.so.3 before libmkl_rt.so.2.
    yield from (str(p) for p in sorted(lib.glob("libmkl_rt.so*"), key=lambda p: p.name, reverse=True))
    found = ctypes.util.find_library("openblas")
    if found:
        yield found
    yield from (p for p in OPENBLAS_PATHS if Path(p).exists())


def _bind(path: str) -> str | None:
    """Load ``path`` into the global symbol scope; the reason it is unusable, or None on success."""
    if "mkl" in Path(path).name:
        for key, value in MKL_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
    try:
        # Probe with a local load first so a library missing CBLAS never enters the global scope.
        probe = ctypes.CDLL(path, mode=ctypes.RTLD_LOCAL)
    except OSError as exc:
        return f"cannot load it ({_first_line(exc)})"
    missing = [name for name in REQUIRED_SYMBOLS if not hasattr(probe, name)]
    if missing:
        return f"it does not export {', '.join(missing)}"
    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    return None


def _describe(path: str) -> str:
    name = Path(path).name
    if "mkl" in name:
        return "Intel MKL"
    if "openblas" in name:
        return "OpenBLAS"
    return name


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
