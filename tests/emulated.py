"""The kernel dispatch bound to the Metal kernels as on a Mac, each launch run by the Metal emulator
(``metal_kernels/emulator``), for tests that drive whole models through the kernels."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mlx_infer.metal_kernels import dispatch
from mlx_infer.metal_kernels.emulator import Emulator

EMULATOR = Emulator()


@contextmanager
def metal_kernels_emulated() -> Iterator[list[str]]:
    """Within: every kernel dispatch goes to the Metal kernels, launched by the emulator; yields the names
    of the kernels launched so far. The dispatch is restored on the way out."""
    launched: list[str] = []

    def launch(spec, **kw):
        launched.append(spec.name)
        return EMULATOR.launch(spec, **kw)

    saved = dispatch.USE_KERNELS
    dispatch.bind(True, launch)
    try:
        yield launched
    finally:
        dispatch.bind(saved)
