"""MLX's own generated Metal source for a kernel call, obtained without a Metal device.

The Linux build raises "No Metal back-end" when a ``metal_kernel`` is evaluated, but tracing the
call through ``mx.export_function`` builds the source and, with ``verbose=True``, prints it from
C++ to file descriptor 1; we capture that descriptor, not ``sys.stdout``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from collections.abc import Sequence

import mlx.core as mx

from mlx_infer.metal_kernels.emulator.errors import KernelCompileError
from mlx_infer.metal_kernels.launch import KernelSpec, TemplateArgs, metal_launch

_FD_LOCK = threading.Lock()  # fd 1 is process-wide: one capture at a time


def generated_source(
    spec: KernelSpec,
    inputs: Sequence[mx.array],
    template: TemplateArgs,
    grid: tuple[int, int, int],
    threadgroup: tuple[int, int, int],
    output_shapes: Sequence[Sequence[int]],
    output_dtypes: Sequence[mx.Dtype],
    init_value: float | None,
) -> str:
    def traced(*arrays: mx.array) -> list[mx.array]:
        return metal_launch(
            spec, inputs=arrays, template=template, grid=grid, threadgroup=threadgroup,
            output_shapes=output_shapes, output_dtypes=output_dtypes, init_value=init_value, verbose=True,
        )

    with _FD_LOCK, tempfile.TemporaryFile(mode="w+b") as sink:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(sink.fileno(), 1)
        try:
            mx.export_function(lambda *_: None, traced, *inputs)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        printed = sink.read().decode()
    marker = f"Generated source code for `{spec.name}`:\n```\n"
    start = printed.rfind(marker)
    if start < 0:
        raise KernelCompileError(f"MLX printed no source for kernel {spec.name!r}")
    body = printed[start + len(marker):]
    return body[: body.rfind("```")]
