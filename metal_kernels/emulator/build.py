"""Compile a translated kernel with the ziglang wheel's clang, cached by content.

The runtime is compiled once per mode into an object file; each kernel is one more compile and a
link. Plain C++ without libc++ (``-nostdinc++ -nostdlib++``): zig would otherwise build libc++ from
source on first use. ThreadSanitizer builds instrument the kernel only (see runtime.cpp).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

from mlx_infer.metal_kernels.emulator.errors import KernelCompileError, ToolchainMissing

HERE = Path(__file__).resolve().parent
_COMMON = ["-std=c++17", "-nostdinc++", "-fno-exceptions", "-fno-rtti", "-g", f"-I{HERE}"]
_KERNEL_FLAGS = ["-O2", "-Wno-unknown-attributes", "-Wno-unused-value", "-Wno-unused-variable"]


def toolchain_available() -> bool:
    return importlib.util.find_spec("ziglang") is not None


def cache_dir() -> Path:
    root = os.environ.get("MLX_INFER_EMULATOR_CACHE") or Path.home() / ".cache" / "mlx-infer" / "emulator"
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def _clang(args: list[str], what: str) -> None:
    if not toolchain_available():
        raise ToolchainMissing("the Metal emulator needs clang from the ziglang wheel: pip install ziglang")
    proc = subprocess.run([sys.executable, "-m", "ziglang", "c++", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise KernelCompileError(f"{what} does not compile:\n{proc.stderr.strip()[:6000]}")


def _mode_flags(tsan: bool) -> list[str]:
    return ["-fsanitize=thread", "-DMTL_TSAN"] if tsan else []


def runtime_object(tsan: bool) -> Path:
    source = (HERE / "runtime.cpp").read_text() + (HERE / "thread_ids.h").read_text()
    key = hashlib.sha256((source + str(tsan)).encode()).hexdigest()[:16]
    obj = cache_dir() / f"runtime-{key}.o"
    if not obj.exists():
        # The runtime itself is never instrumented: only kernel accesses are race-checked.
        flags = ["-O2", "-DMTL_TSAN"] if tsan else ["-O2"]
        tmp = obj.with_suffix(f".{os.getpid()}.o")
        _clang(["-c", str(HERE / "runtime.cpp"), "-o", str(tmp), *_COMMON, *flags], "the emulator runtime")
        tmp.replace(obj)
    return obj


def kernel_executable(cpp: str, tsan: bool) -> Path:
    """Path of the executable for one translated kernel (built on first request)."""
    shim = (HERE / "metal_shim.h").read_text() + (HERE / "thread_ids.h").read_text()
    runtime = runtime_object(tsan)
    key = hashlib.sha256((cpp + shim + runtime.name + str(tsan)).encode()).hexdigest()[:20]
    exe = cache_dir() / f"kernel-{key}{'-tsan' if tsan else ''}"
    if not exe.exists():
        src = exe.with_suffix(".cpp")
        src.write_text(cpp)
        tmp = exe.with_suffix(f".{os.getpid()}.tmp")
        _clang([str(src), str(runtime), "-o", str(tmp), *_COMMON, *_KERNEL_FLAGS, *_mode_flags(tsan),
                "-nostdlib++", "-lpthread"], "the kernel")
        tmp.replace(exe)
    return exe
