"""From a built model's parameters to the output tensors, one layer at a time and lazily.

Nothing here evaluates: every output tensor is an MLX graph over the (memory-mapped or loaded) source
tensor, computed when its shard is written. The source tensor's only reference is popped from the
parameter dict into that graph, so once a shard is evaluated its sources are freed and peak memory stays
near one shard.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from .quant import QuantParams


@dataclass(frozen=True)
class Layer:
    """A layer whose weight can be quantized (Linear, Embedding, stacked MoE experts)."""

    path: str
    source: QuantParams | None  # how the checkpoint stores it; None: floating point
    in_features: int  # the quantized axis (the last one)


@dataclass
class Group:
    """The output tensors of one layer (or one other parameter)."""

    tensors: dict[str, mx.array]
    n_params: int  # weights it stands for, counting each quantized value as one

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def quantizable_layers(model: nn.Module) -> dict[str, Layer]:
    layers = {}
    for path, m in model.named_modules():
        if "scales" in m and hasattr(m, "bits"):  # QuantizedLinear/Embedding, quantized experts
            mode = getattr(m, "mode", "affine")
            in_features = m.weight.shape[-1] * 32 // m.bits
            layers[path] = Layer(path, QuantParams(m.group_size, m.bits, mode), in_features)
        elif hasattr(m, "to_quantized") and "weight" in m:
            layers[path] = Layer(path, None, m.weight.shape[-1])
    return layers


def source_params(model: nn.Module) -> dict[str, mx.array]:
    return dict(tree_flatten(model.parameters()))


def output_groups(
    params: dict[str, mx.array],
    layers: dict[str, Layer],
    targets: dict[str, QuantParams | None],
    dtype: mx.Dtype,
) -> list[Group]:
    """Lazy output tensors in parameter order; ``params`` is emptied (see the module docstring).

    ``targets[path]`` is the quantization of layer ``path`` in the output (None: floating point);
    every floating tensor that is not quantized is cast to ``dtype``.
    """
    groups = []
    for name in list(params):
        if name not in params:  # already taken with its layer
            continue
        path = name.rpartition(".")[0]
        if path in layers and name == f"{path}.weight":
            groups.append(_layer_group(params, layers[path], targets[path], dtype))
        else:
            value = params.pop(name)
            groups.append(Group({name: _cast(value, dtype)}, value.size))
    return groups


def dequantized(w: mx.array, scales: mx.array, biases: mx.array | None, q: QuantParams) -> mx.array:
    """The float32 weight a quantized one stands for. Floating scales are widened first, so the values
    are computed in float32 and not in the float16 the scales may come in."""
    if mx.issubdtype(scales.dtype, mx.floating):
        scales = scales.astype(mx.float32)
    if biases is not None:
        biases = biases.astype(mx.float32)
    return mx.dequantize(w, scales, biases, group_size=q.group_size, bits=q.bits, mode=q.mode)


def _layer_group(
    params: dict[str, mx.array], layer: Layer, target: QuantParams | None, dtype: mx.Dtype
) -> Group:
    p, src = layer.path, layer.source
    w = params.pop(f"{p}.weight")
    scales = params.pop(f"{p}.scales", None)
    biases = params.pop(f"{p}.biases", None)
    out: dict[str, mx.array] = {}
    if src is not None and target == src:  # kept as the checkpoint has it: bit-exact
        out[f"{p}.weight"] = w
        out[f"{p}.scales"] = _cast(scales, dtype)
        if biases is not None:
            out[f"{p}.biases"] = _cast(biases, dtype)
    elif src is not None and target is not None and target.holds(src):
        assert biases is not None  # holds() is only true between affine grids, which have biases
        out[f"{p}.weight"] = pack(codes(w, scales, src), target.bits)
        split = src.group_size // target.group_size  # each source group's s and b, once per output group
        out[f"{p}.scales"] = _cast(mx.repeat(scales, split, axis=-1), dtype)
        out[f"{p}.biases"] = _cast(mx.repeat(biases, split, axis=-1), dtype)
    else:
        full = w if src is None else dequantized(w, scales, biases, src)
        full = full.astype(dtype)
        if target is None:
            out[f"{p}.weight"] = full
        else:
            packed, q_scales, *q_biases = mx.quantize(full, target.group_size, target.bits, mode=target.mode)
            out[f"{p}.weight"], out[f"{p}.scales"] = packed, q_scales
            if q_biases:
                out[f"{p}.biases"] = q_biases[0]
    n_params = math.prod(w.shape[:-1]) * layer.in_features
    return Group(out, n_params)


def codes(w: mx.array, scales: mx.array, q: QuantParams) -> mx.array:
    """The integer codes of an affine quantized weight, uint32 [..., in_features] (dequantized with
    scale 1 and bias 0: at most 8 bits, so exact in floating point)."""
    ones = mx.ones(scales.shape, dtype=mx.float32)
    zeros = mx.zeros(scales.shape, dtype=mx.float32)
    return mx.dequantize(w, ones, zeros, group_size=q.group_size, bits=q.bits).astype(mx.uint32)


def pack(values: mx.array, bits: int) -> mx.array:
    """``values`` (uint32, each below 2**bits) packed as MLX packs quantized weights: each row one
    little-endian bit stream, value i in bits [i·bits, (i+1)·bits), read as uint32 words. Every 32
    values fill exactly ``bits`` words."""
    *lead, n = values.shape
    chunks = values.reshape(*lead, n // 32, 32)
    words = [mx.zeros((*lead, n // 32), dtype=mx.uint32) for _ in range(bits)]
    for i in range(32):
        word, shift = divmod(i * bits, 32)
        v = chunks[..., i]
        words[word] = words[word] | (v << shift)
        if shift + bits > 32:  # the value straddles two words: its high bits start the next one
            words[word + 1] = words[word + 1] | (v >> (32 - shift))
    return mx.stack(words, axis=-1).reshape(*lead, n * bits // 32)


def _cast(value: mx.array, dtype: mx.Dtype) -> mx.array:
    return value.astype(dtype) if mx.issubdtype(value.dtype, mx.floating) else value
