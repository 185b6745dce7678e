"""Quantized layers computed by the native CPU kernels: what the weight policy swaps in on the CPU.

Each twin *is* the MLX layer it replaces (same class hierarchy and parameter names), so checkpoints,
the weight policy and conversion see an ordinary ``nn.QuantizedLinear``/``nn.QuantizedEmbedding``;
only the product differs. Scales and biases are widened to float32 once here, which is what the
kernel reads (a few percent of the weight bytes).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_infer import cpu_kernels


def _adopt(new: nn.Module, layer: nn.Module) -> None:
    """Give ``new`` ``layer``'s settings and parameters without running the MLX constructor (which
    would draw and quantize a random weight only to drop it)."""
    nn.Module.__init__(new)
    new.group_size, new.bits, new.mode = layer.group_size, layer.bits, layer.mode
    for name, value in layer.items():  # weight, scales, biases and, when present, bias
        widen = name in ("scales", "biases", "bias") and value.dtype != mx.float32
        new[name] = value.astype(mx.float32) if widen else value
    new.freeze()


class CPUQuantizedLinear(nn.QuantizedLinear):
    """An affine ``nn.QuantizedLinear`` whose product is the native matvec kernel."""

    def __init__(self, layer: nn.QuantizedLinear):
        _adopt(self, layer)

    def __call__(self, x: mx.array) -> mx.array:
        y = cpu_kernels.quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
        )
        bias = self.get("bias")
        return y if bias is None else y + bias


class CPUQuantizedEmbedding(nn.QuantizedEmbedding):
    """An affine ``nn.QuantizedEmbedding`` whose ``as_linear`` (a tied head) is the native kernel;
    lookups stay MLX's."""

    def __init__(self, layer: nn.QuantizedEmbedding):
        _adopt(self, layer)
        self.num_embeddings, self.dims = layer.num_embeddings, layer.dims

    def as_linear(self, x: mx.array) -> mx.array:
        return cpu_kernels.quantized_matmul(
            x, self["weight"], self["scales"], self["biases"], self.group_size, self.bits
        )


def use_cpu_kernels(model: nn.Module) -> int:
    """Swap every affine 4/8-bit quantized layer of ``model`` for its kernel twin; returns how many."""
    twins = {nn.QuantizedLinear: CPUQuantizedLinear, nn.QuantizedEmbedding: CPUQuantizedEmbedding}
    swaps = [
        (path, twins[type(m)](m))
        for path, m in model.named_modules()
        if type(m) in twins and m.mode == "affine" and m.bits in (4, 8)
    ]
    model.update_modules(tree_unflatten(swaps))
    return len(swaps)
