"""Bind an optimized BLAS for MLX's Linux CPU backend.

MLX's Linux CPU wheel links the reference (netlib) BLAS, which makes float32 matmuls 10-60x slower
than they need to be. ``libmlx.so`` resolves ``cblas_sgemm`` (and its LAPACK calls) through the
global symbol scope first, so a library loaded with ``RTLD_GLOBAL`` *before* ``mlx.core`` is
imported wins; no LD_PRELOAD or re-exec is needed. Python loads extensions with RTLD_NOW, so once
``mlx.core`` is imported its symbols are bound for good and loading a BLAS afterwards does nothing.

``setup()`` runs at the top of ``mlx_infer/__init__.py``. Choice, in order:
``MLX_INFER_BLAS=off`` (keep the reference BLAS), ``MLX_INFER_BLAS=/path/to/lib.so``,
``MLX_INFER_BLAS=numpy`` (the last candidate below, forced), PyPI's ``mkl`` (``libmkl_rt.so.*`` in
``sys.prefix/lib``, the ``[blas]`` extra), the system's OpenBLAS (Debian's ``libopenblas0``), and numpy's
own OpenBLAS, which every install has: numpy's Linux wheels bundle an ILP64 OpenBLAS whose symbols are
renamed (``scipy_cblas_sgemm64_``), so a small shim (``cblas_shim.c``, compiled once with the C
compiler the native kernels need anyway, cached) forwards MLX's three CBLAS calls to it.
Nothing is done off Linux: macOS builds of MLX use Accelerate.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "MLX_INFER_BLAS"
NUMPY = "numpy"  # MLX_INFER_BLAS=numpy: numpy's bundled OpenBLAS through the shim
SHIM_SOURCE = Path(__file__).with_name("cblas_shim.c")
OPENBLAS_THREADS_VAR = "OPENBLAS_NUM_THREADS"  # read by OpenBLAS itself when it loads; we default it to 1

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
    if requested.lower() == NUMPY:
        active, error = _bind_numpy()
        if error is None:
            return active
        logger.warning("%s=%s: %s; using MLX's reference BLAS", ENV_VAR, requested, error)
        return f"reference BLAS ({ENV_VAR}=numpy unusable: {error})"
    if requested:
        error = _bind(requested)
        if error is None:
            return f"{_describe(requested)} ({requested})"
        logger.warning("%s=%s: %s; using MLX's reference BLAS", ENV_VAR, requested, error)
        return f"reference BLAS ({ENV_VAR} path unusable: {error})"
    for path in _candidates():
        if _bind(path) is None:
            return f"{_describe(path)} ({path})"
    active, error = _bind_numpy()
    if error is None:
        return active
    # Not a warning: the load line that prints the BLAS says so, and says why.
    return f"reference BLAS (no optimized BLAS found; numpy's OpenBLAS: {error})"


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


def _bind_numpy() -> tuple[str, str | None]:
    """Bind numpy's bundled OpenBLAS through the shim: (description, None), or ("", the reason not)."""
    found = numpy_openblas()
    if found is None:
        return "", "numpy bundles no OpenBLAS here"
    try:
        library = ctypes.CDLL(found)  # numpy's own copy when numpy is already imported: one library
    except OSError as exc:
        return "", f"cannot load {found} ({_first_line(exc)})"
    prefix = next((p for p in ("scipy_", "") if hasattr(library, f"{p}cblas_sgemm64_")), None)
    if prefix is None:
        return "", f"{found} exports no cblas_sgemm64_"
    try:
        shim_path = load_shim(library, prefix)[1]
    except (OSError, subprocess.SubprocessError) as exc:
        return "", f"cannot compile the CBLAS shim ({_first_line(exc)})"
    ctypes.CDLL(str(shim_path), mode=ctypes.RTLD_GLOBAL)  # the same object, now in the global scope
    threads = os.environ.get(OPENBLAS_THREADS_VAR)
    if threads is None:
        # Its pthreads spin-wait inside each call: beside MLX's own CPU thread and the native kernels'
        # pool on a 2-core VM, two threads made a 64-row 576->1536 product 10-20x slower (and float32
        # decode stall) where one thread matched MKL. This is numpy's library too, so numpy's own
        # products in this process also run on one thread.
        getattr(library, f"{prefix}openblas_set_num_threads64_")(1)
    return f"numpy's OpenBLAS ({found}, via {shim_path}; {OPENBLAS_THREADS_VAR}={threads or 1})", None


def load_shim(library: ctypes.CDLL, prefix: str) -> tuple[ctypes.CDLL, Path]:
    """The shim (compiled if needed), loaded locally, its pointers set to ``library``'s functions."""
    path = _shim()
    shim = ctypes.CDLL(str(path), mode=ctypes.RTLD_LOCAL)
    for name in ("sgemm", "sgemv", "dgemm", "cgemm"):  # set before any of its functions can be called
        target = ctypes.cast(getattr(library, f"{prefix}cblas_{name}64_"), ctypes.c_void_p)
        ctypes.c_void_p.in_dll(shim, f"mlx_infer_{name}").value = target.value
    return shim, path


def numpy_openblas() -> str | None:
    """The OpenBLAS numpy's wheel bundles in ``numpy.libs`` (found without importing numpy)."""
    spec = importlib.util.find_spec("numpy")
    if spec is None or spec.origin is None:
        return None
    libs = Path(spec.origin).parent.parent / "numpy.libs"
    found = sorted(libs.glob("lib*openblas64_*.so*"))
    return str(found[0]) if found else None


def _shim() -> Path:
    """The compiled shim, built on first use and cached by its source and the machine."""
    source = SHIM_SOURCE.read_bytes()
    key = hashlib.sha256(source + platform.machine().encode()).hexdigest()[:16]
    cache = Path(os.environ.get("MLX_INFER_CACHE", Path.home() / ".cache" / "mlx-infer")) / "blas"
    path = cache / f"libmlx_infer_cblas-{key}.so"
    if path.exists():
        return path
    compiler = next((c for c in (os.environ.get("CC"), "cc", "gcc", "clang") if c and shutil.which(c)), None)
    if compiler is None:
        raise OSError("no C compiler (cc, gcc or clang) on PATH")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:  # built aside, renamed in: never half-written
        built = Path(tmp) / path.name
        proc = subprocess.run([compiler, "-O2", "-shared", "-fPIC", str(SHIM_SOURCE), "-o", str(built)],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise OSError(f"{compiler} failed: {proc.stderr.strip() or proc.returncode}")
        os.replace(built, path)
    return path


def _describe(path: str) -> str:
    name = Path(path).name
    if "mkl" in name:
        return "Intel MKL"
    if "openblas" in name:
        return "OpenBLAS"
    return name


def _first_line(exc: BaseException) -> str:
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__
