"""Model layers whose matmuls go through the kernel dispatch: what the loader swaps in on Metal.

- :class:`KernelQuantizedLinear` is an ``nn.QuantizedLinear`` (same parameters, so checkpoints,
  the weight policy and conversion treat it as one) whose product is ``dispatch.quantized_matmul``:
  the fused dequantize + matvec kernel for decode, MLX's own quantized matmul for prefill;
  :class:`KernelQuantizedEmbedding` does the same for a tied head (``as_linear``).
- :class:`GGUFLinear` and :class:`GGUFEmbedding` hold GGUF K-quant rows as their raw blocks
  (``weight`` uint8 ``[rows, in_features / 256 * block_bytes]``), which MLX's affine format cannot
  express; products go through ``dispatch.gguf_matmul``, so the weights are never re-quantized.

Each call looks ``dispatch.<name>`` up at call time, so a test that re-binds the dispatch (the emulator
as launcher) runs these layers through the kernels without Metal.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.interface.watched import Watched
from mlx_infer.metal_kernels import dispatch
from mlx_infer.metal_kernels.gguf_reference import BLOCK_BYTES, DEQUANTIZE, QK_K


def _adopt(new: nn.Module, layer: nn.Module) -> None:
    """Give ``new`` the quantization settings and parameters of ``layer`` (arrays shared, not copied).

    Used instead of the MLX constructors, which would draw and quantize a random weight only to drop it.
    """
    nn.Module.__init__(new)
    new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
    for name, value in layer.items():  # weight, scales, biases and, when present, bias
        new[name] = value
    new.freeze()


class KernelQuantizedLinear(Watched, nn.QuantizedLinear):
    """An affine ``nn.QuantizedLinear`` computed by ``dispatch.quantized_matmul`` (:class:`Watched`: the
    native blocks bind its arrays)."""

    def __init__(self, layer: nn.QuantizedLinear):
        _adopt(self, layer)

    def __call__(self, x: mx.array) -> mx.array:
        return dispatch.quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits, self.get("bias")
        )


class KernelQuantizedEmbedding(nn.QuantizedEmbedding):
    """An affine ``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied head) is ``dispatch.quantized_matmul``.

    Lookups dequantize the gathered rows as MLX's do, in ``lookup_dtype`` when given (the CPU policy's
    float32, where the scales stay float16: the rows are computed from the widened scales, exactly), else
    in the scales' dtype."""

    def __init__(self, layer: nn.QuantizedEmbedding, lookup_dtype: mx.Dtype | None = None):
        _adopt(self, layer)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims
        self.lookup_dtype = lookup_dtype

    def __call__(self, x: mx.array) -> mx.array:
        if self.lookup_dtype is None:
            return super().__call__(x)
        if self.lookup_dtype == mx.float32:
            native = cpu_kernels.embed_rows(
                x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
            )
            if native is not None:
                return native
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(self.lookup_dtype),
            biases=self["biases"][x].astype(self.lookup_dtype),
            group_size=self.group_size,
            bits=self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return dispatch.quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
        )


def _raw_shape(rows: int, features: int, kind: str) -> tuple[int, int]:
    return rows, features // QK_K * BLOCK_BYTES[kind]


class GGUFLinear(nn.Module):
    """``x @ W.T (+ bias)`` with ``W`` kept as GGUF ``kind`` blocks, one row of bytes per output feature."""

    def __init__(self, input_dims: int, output_dims: int, kind: str, bias: bool):
        super().__init__()
        self.kind = kind
        self.weight = mx.zeros(_raw_shape(output_dims, input_dims, kind), dtype=mx.uint8)
        if bias:
            self.bias = mx.zeros((output_dims,))
        self.freeze()

    def __call__(self, x: mx.array) -> mx.array:
        return dispatch.gguf_matmul(x, self["weight"], self.kind, self.get("bias"))


class GGUFEmbedding(nn.Module):
    """An embedding table kept as GGUF ``kind`` blocks: a lookup dequantizes only the rows it gathers
    (float32, exactly); ``as_linear`` (a tied head) is ``dispatch.gguf_matmul``."""

    def __init__(self, num_embeddings: int, dims: int, kind: str):
        super().__init__()
        self.kind = kind
        self.weight = mx.zeros(_raw_shape(num_embeddings, dims, kind), dtype=mx.uint8)
        self.freeze()

    def __call__(self, tokens: mx.array) -> mx.array:
        rows = DEQUANTIZE[self.kind](self["weight"][tokens.reshape(-1)])
        return rows.reshape(*tokens.shape, rows.shape[-1])

    def as_linear(self, x: mx.array) -> mx.array:
        return dispatch.gguf_matmul(x, self["weight"], self.kind)
