"""The one place that chooses between a Metal kernel and its pure-MLX reference.

Off Metal the reference is chosen silently (for attention and affine 4/8-bit products, the native
CPU kernels of ``mlx_infer.cpu_kernels`` where they are built); on Metal the kernel, unless
``MLX_INFER_KERNELS=reference``, which also turns the CPU kernels off. The choice is made once at
import and bound to module names, so a call costs nothing extra. Callers look the names up at call time
(``dispatch.quantized_matmul(...)``), so :func:`bind` can re-point them: tests bind the kernels
with the Metal emulator as their launcher and run whole models through the kernel path on Linux.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from functools import partial

import mlx.core as mx

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.metal_kernels import gguf_reference, reference
from mlx_infer.metal_kernels.launch import Launcher, metal_launch


def _kernel_paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: mx.array | None = None,
    value_dim: int | None = None,
    *,
    launch: Launcher = metal_launch,
) -> mx.array:
    from mlx_infer.metal_kernels.paged_attention import paged_attention

    return paged_attention(queries, key_pool, value_pool, meta, scale, sliding_window, logit_softcap, sinks,
                           value_dim, launch=launch)


def _kernel_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
    residual: mx.array | None = None,
    *,
    launch: Launcher = metal_launch,
) -> mx.array:
    from mlx_infer.metal_kernels.quantized import MAX_ROWS, affine_matvec

    rows = math.prod(x.shape[:-1])
    if rows <= MAX_ROWS and bits in (4, 8) and group_size in (32, 64, 128):
        res = None if residual is None else residual.reshape(rows, -1)
        out = affine_matvec(x.reshape(rows, x.shape[-1]), w, scales, biases, group_size, bits, bias, res,
                            launch=launch)
        return out.reshape(*x.shape[:-1], w.shape[0])
    # Prefill-sized inputs: MLX's own tiled quantized matmul is the right kernel on a GPU.
    out = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    return _epilogue(out, bias, residual)


def _epilogue(out: mx.array, bias: mx.array | None, residual: mx.array | None) -> mx.array:
    """``out (+ bias) (+ residual)`` for the paths whose product has no fused epilogue."""
    if bias is not None:
        out = out + bias
    return out if residual is None else out + residual


def _kernel_gguf_matmul(
    x: mx.array, raw: mx.array, kind: str, bias: mx.array | None = None, *, launch: Launcher = metal_launch
) -> mx.array:
    from mlx_infer.metal_kernels.quantized import MAX_ROWS, kquant_matvec

    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS:
        return gguf_reference.gguf_matmul(x, raw, kind, bias)
    out = kquant_matvec(x.reshape(rows, x.shape[-1]), raw, kind, bias, launch=launch)
    return out.reshape(*x.shape[:-1], raw.shape[0])


def _kernel_gated_delta(
    *args: mx.array | None, launch: Launcher = metal_launch
) -> tuple[mx.array, mx.array] | None:
    from mlx_infer.metal_kernels.gated_delta import gated_delta

    return gated_delta(*args, launch=launch)


def _no_kernel(*args: mx.array | None) -> None:
    return None


def _cpu_paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: mx.array | None = None,
    value_dim: int | None = None,
) -> mx.array:
    """Off Metal: the native CPU kernel where it is built and the dtypes suit it, else the reference."""
    if cpu_kernels.supports_attention(queries, key_pool) and (value_dim or 0) % 8 == 0:
        return cpu_kernels.paged_attention(
            queries, key_pool, value_pool, meta, scale, sliding_window, logit_softcap, sinks, value_dim
        )
    return reference.paged_attention(
        queries, key_pool, value_pool, meta, scale, sliding_window, logit_softcap, sinks, value_dim
    )


def _cpu_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
    residual: mx.array | None = None,
) -> mx.array:
    """Off Metal: the native CPU kernel where it is built and supports the layer, else the reference."""
    if not cpu_kernels.supports_quantized(scales, group_size, bits):
        return reference.quantized_matmul(x, w, scales, biases, group_size, bits, bias, residual)
    out = cpu_kernels.quantized_matmul(x, w, scales, biases, group_size, bits)
    return _epilogue(out, bias, residual).astype(x.dtype)


def bind(kernels: bool, launch: Launcher = metal_launch) -> None:
    """Point the entry points (and ``USE_KERNELS``) at the kernels, launched by ``launch``, or at the
    references. Done once at import; tests re-bind with the emulator's launch and bind back."""
    global USE_KERNELS, paged_attention, quantized_matmul, gguf_matmul, gated_delta
    USE_KERNELS = kernels
    if not kernels:
        paged_attention = _cpu_paged_attention
        quantized_matmul = _cpu_quantized_matmul
        gguf_matmul = gguf_reference.gguf_matmul
        # No Metal kernel: models/gated_delta.py uses the native CPU kernel where it applies, else MLX ops.
        gated_delta = _no_kernel
    else:
        paged_attention = partial(_kernel_paged_attention, launch=launch)
        quantized_matmul = partial(_kernel_quantized_matmul, launch=launch)
        gguf_matmul = partial(_kernel_gguf_matmul, launch=launch)
        gated_delta = partial(_kernel_gated_delta, launch=launch)


USE_KERNELS: bool
paged_attention: Callable[..., mx.array]
quantized_matmul: Callable[..., mx.array]
gguf_matmul: Callable[..., mx.array]
# The Gated DeltaNet recurrence (decode steps and multi-token rows), or None: no Metal kernel
gated_delta: Callable[..., tuple[mx.array, mx.array] | None]
bind(mx.metal.is_available() and os.environ.get("MLX_INFER_KERNELS", "") != "reference")
