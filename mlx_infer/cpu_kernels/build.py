"""Build (once, on first use) and load the native CPU kernels, a C++ MLX extension.

The module links ``libmlx.so`` and passes ``mx.array`` through nanobind, so it must be compiled
against the MLX actually installed: that is why it is built here, on the user's machine, rather than
shipped prebuilt or built by pip (whose isolated build environment may hold another MLX). The build
uses CMake, the C++ compiler CMake finds, MLX's own CMake package and nanobind; it takes about
40 s on two cores and is cached under ``~/.cache/mlx-infer/cpu_kernels/<key>``, the key covering the
sources, MLX, nanobind, Python and the machine. Anything missing (no compiler, no CMake, a CPU
without AVX2/FMA, an MLX whose nanobind ABI differs) leaves the kernels unavailable with one
logged reason, and callers fall back to MLX's own ops.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("mlx_infer")

SOURCE_DIR = Path(__file__).resolve().parent
MODULE_NAME = "_cpu_kernels"
ENV_VAR = "MLX_INFER_CPU_KERNELS"  # "off" disables the kernels


def cache_root() -> Path:
    return Path(os.environ.get("MLX_INFER_CACHE", Path.home() / ".cache" / "mlx-infer")) / "cpu_kernels"


class Unavailable(Exception):
    """Why the native kernels cannot be used in this process (one line)."""


def load() -> ModuleType:
    """The built module, building it first if needed; raises :class:`Unavailable`."""
    if os.environ.get(ENV_VAR, "").strip().lower() == "off":
        raise Unavailable(f"{ENV_VAR}=off")
    if os.environ.get("MLX_INFER_KERNELS", "").strip() == "reference":
        raise Unavailable("MLX_INFER_KERNELS=reference")
    _check_machine()
    import mlx.core as mx
    import nanobind

    folder = cache_root() / _key(mx.__version__, nanobind.__version__)
    library = folder / (MODULE_NAME + sysconfig.get_config_var("EXT_SUFFIX"))
    if not library.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # Two processes starting at once (a server and a test run) build once; the second waits.
        with open(folder / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not library.exists():
                _build(folder, library, nanobind.cmake_dir())
    module = _import(library)
    _check_abi(module, mx)
    return module


def _check_machine() -> None:
    if not sys.platform.startswith("linux"):
        raise Unavailable("the native CPU kernels are built for Linux only")
    if platform.machine() not in ("x86_64", "AMD64"):
        raise Unavailable(f"no native CPU kernels for {platform.machine()} yet")
    flags = _cpu_flags()
    missing = [f for f in ("avx2", "fma", "f16c") if f not in flags]
    if missing:
        raise Unavailable(f"the CPU lacks {', '.join(missing)}")


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _sources() -> list[Path]:
    return sorted([SOURCE_DIR / "CMakeLists.txt", *(SOURCE_DIR / "src").glob("*.[ch]*")])


def _key(mlx_version: str, nanobind_version: str) -> str:
    digest = hashlib.sha256()
    for path in _sources():
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(f"{mlx_version}|{nanobind_version}|{sys.version}|{platform.machine()}".encode())
    return digest.hexdigest()[:16]


def _build(folder: Path, library: Path, nanobind_dir: str) -> None:
    cmake = shutil.which("cmake")
    if cmake is None:
        raise Unavailable("cmake not found (install it, e.g. `pip install cmake`, to build the CPU kernels)")
    import mlx.core

    # Beside mlx/core*.so, not mlx.__path__[0]: mlx is a namespace package, so any folder named mlx
    # earlier on sys.path (MLX's own JIT cache /tmp/mlx, for a script run from /tmp) comes first there.
    mlx_dir = Path(mlx.core.__file__).parent / "share" / "cmake" / "MLX"
    log_path = folder / "build.log"
    started = time.perf_counter()
    log.warning("building mlx-infer's native CPU kernels once (about a minute; cached in %s)", folder)
    with tempfile.TemporaryDirectory(dir=folder) as build_dir, open(log_path, "w") as out:
        steps = [
            [cmake, "-S", str(SOURCE_DIR), "-B", build_dir, "-DCMAKE_BUILD_TYPE=Release",
             f"-DPython_EXECUTABLE={sys.executable}", f"-Dnanobind_ROOT={nanobind_dir}",
             f"-DMLX_DIR={mlx_dir}"],
            [cmake, "--build", build_dir, "-j", str(os.cpu_count() or 1)],
        ]
        for cmd in steps:
            if subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT).returncode != 0:
                raise Unavailable(f"building the CPU kernels failed (see {log_path})")
        built = next(Path(build_dir).glob(MODULE_NAME + "*.so"), None)
        if built is None:
            raise Unavailable(f"building the CPU kernels produced no module (see {log_path})")
        # Rename is atomic: another process never imports a half-written library.
        partial = library.with_suffix(".partial")
        shutil.copy2(built, partial)
        partial.rename(library)
    log.info("CPU kernels built in %.0f s", time.perf_counter() - started)


def _import(library: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(MODULE_NAME, library)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError as e:
        raise Unavailable(f"the built CPU kernels do not load: {e}") from e
    return module


def _check_abi(module: ModuleType, mx) -> None:
    """An MLX built with another nanobind ABI would reject ``mx.array`` arguments: try one call."""
    w, scales, biases = mx.quantize(mx.zeros((8, 32)), group_size=32, bits=4)
    try:
        out = module.affine_qmv(mx.ones((1, 32)), w, scales, biases, 32, 4)
        mx.eval(out)
    except TypeError as e:
        raise Unavailable(f"the CPU kernels cannot exchange arrays with this MLX build: {e}") from e
