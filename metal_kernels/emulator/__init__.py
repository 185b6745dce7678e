"""Metal emulator: runs ``mx.fast.metal_kernel`` bodies on the CPU, as MLX would compile them for a Mac.

See runner.py (what a launch does), translate.py (source rewrites and known gaps), metal_shim.h
(Metal as C++) and runtime.cpp (threads as fibers, guard pages, barrier checks).
"""

from mlx_infer.metal_kernels.emulator.build import toolchain_available
from mlx_infer.metal_kernels.emulator.errors import (
    BarrierDivergence,
    DataRace,
    EmulatorError,
    KernelCompileError,
    KernelFault,
    KernelTimeout,
    OutOfBounds,
    ToolchainMissing,
    UnwrittenOutput,
)
from mlx_infer.metal_kernels.emulator.runner import Emulator

__all__ = [
    "BarrierDivergence", "DataRace", "Emulator", "EmulatorError", "KernelCompileError", "KernelFault",
    "KernelTimeout", "OutOfBounds", "ToolchainMissing", "UnwrittenOutput", "toolchain_available",
]
