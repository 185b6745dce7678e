"""How a kernel body is launched: one description, two launchers.

Every kernel in this package is a :class:`KernelSpec` (what ``mx.fast.metal_kernel`` is built from)
launched through a :data:`Launcher`. :func:`metal_launch` runs it on the GPU; the emulator's
``Emulator.launch`` has the same signature and runs the same body on the CPU, so the Python code
around a kernel (shapes, grids, the split-KV reduce) is exercised identically in both.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any, Protocol

import mlx.core as mx


@dataclass(frozen=True)
class KernelSpec:
    name: str
    input_names: tuple[str, ...]
    output_names: tuple[str, ...]
    source: str
    header: str = ""
    ensure_row_contiguous: bool = True
    atomic_outputs: bool = False


TemplateArgs = Sequence[tuple[str, Any]]


class Launcher(Protocol):
    def __call__(
        self,
        spec: KernelSpec,
        *,
        inputs: Sequence[mx.array],
        template: TemplateArgs,
        grid: tuple[int, int, int],
        threadgroup: tuple[int, int, int],
        output_shapes: Sequence[Sequence[int]],
        output_dtypes: Sequence[mx.Dtype],
        init_value: float | None = None,
    ) -> list[mx.array]: ...


@cache
def compiled(spec: KernelSpec) -> Any:
    """The ``mx.fast.metal_kernel`` object of a spec (MLX caches the Metal library by name and source)."""
    return mx.fast.metal_kernel(
        name=spec.name,
        input_names=list(spec.input_names),
        output_names=list(spec.output_names),
        source=spec.source,
        header=spec.header,
        ensure_row_contiguous=spec.ensure_row_contiguous,
        atomic_outputs=spec.atomic_outputs,
    )


def metal_launch(
    spec: KernelSpec,
    *,
    inputs: Sequence[mx.array],
    template: TemplateArgs,
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[mx.Dtype],
    init_value: float | None = None,
    verbose: bool = False,
) -> list[mx.array]:
    return compiled(spec)(
        inputs=list(inputs),
        template=list(template),
        grid=grid,
        threadgroup=threadgroup,
        output_shapes=[tuple(s) for s in output_shapes],
        output_dtypes=list(output_dtypes),
        init_value=init_value,
        verbose=verbose,
    )
