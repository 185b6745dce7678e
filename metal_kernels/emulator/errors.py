"""What the emulator reports: each failure class a kernel can have on a Mac, as its own error."""

from __future__ import annotations

from mlx_infer.errors import MlxInferError


class EmulatorError(MlxInferError):
    """A kernel failed under emulation; the message names the kernel and what went wrong."""


class ToolchainMissing(EmulatorError):
    """The ziglang clang is not installed (``pip install ziglang``)."""


class KernelCompileError(EmulatorError):
    """The generated Metal source does not compile against the shim."""


class OutOfBounds(EmulatorError):
    """A thread read or wrote past the end of a buffer (it hit the guard page)."""


class BarrierDivergence(EmulatorError):
    """Threads of one threadgroup did not all reach the same ``threadgroup_barrier`` (a hang on a Mac)."""


class DataRace(EmulatorError):
    """ThreadSanitizer saw unsynchronised accesses, or two schedules gave different outputs."""


class KernelTimeout(EmulatorError):
    """The emulated launch did not finish in time (an endless loop, or a launch far too large)."""


class KernelFault(EmulatorError):
    """Any other failure inside the kernel: a crash, an invalid SIMD shuffle, threadgroup memory overuse."""


class UnwrittenOutput(EmulatorError):
    """Output elements still hold the NaN the emulator filled them with: no thread wrote them."""
