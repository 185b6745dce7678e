"""The one place that chooses between a Metal kernel and its pure-MLX reference.

Off Metal the reference is chosen silently; on Metal the kernel, unless
``MLX_INFER_KERNELS=reference``. The choice is made once at import and bound to module names,
so a call costs nothing extra on the CPU.
"""

from __future__ import annotations

import math
import os

import mlx.core as mx

from mlx_infer.metal_kernels import gguf_reference, reference
from mlx_infer.models.base import BatchMetadata

USE_KERNELS = mx.metal.is_available() and os.environ.get("MLX_INFER_KERNELS", "") != "reference"


def _kernel_paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
) -> mx.array:
    from mlx_infer.metal_kernels.paged_attention import paged_attention

    return paged_attention(queries, key_pool, value_pool, meta, scale, sliding_window, logit_softcap)


def _kernel_quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
    residual: mx.array | None = None,
) -> mx.array:
    from mlx_infer.metal_kernels.quantized import MAX_ROWS, affine_matvec

    rows = math.prod(x.shape[:-1])
    if rows <= MAX_ROWS and bits in (4, 8) and group_size in (32, 64, 128):
        res = None if residual is None else residual.reshape(rows, -1)
        out = affine_matvec(x.reshape(rows, x.shape[-1]), w, scales, biases, group_size, bits, bias, res)
        return out.reshape(*x.shape[:-1], w.shape[0])
    # Prefill-sized inputs: MLX's own tiled quantized matmul is the right kernel on a GPU.
    out = mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size=group_size, bits=bits)
    if bias is not None:
        out = out + bias
    return out if residual is None else out + residual


def _kernel_gguf_matmul(x: mx.array, raw: mx.array, kind: str, bias: mx.array | None = None) -> mx.array:
    from mlx_infer.metal_kernels.quantized import MAX_ROWS, kquant_matvec

    rows = math.prod(x.shape[:-1])
    if rows > MAX_ROWS:
        return gguf_reference.gguf_matmul(x, raw, kind, bias)
    return kquant_matvec(x.reshape(rows, x.shape[-1]), raw, kind, bias).reshape(*x.shape[:-1], raw.shape[0])


if USE_KERNELS:
    paged_attention = _kernel_paged_attention
    quantized_matmul = _kernel_quantized_matmul
    gguf_matmul = _kernel_gguf_matmul
else:
    paged_attention = reference.paged_attention
    quantized_matmul = reference.quantized_matmul
    gguf_matmul = gguf_reference.gguf_matmul
