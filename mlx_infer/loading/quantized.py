"""Turning a freshly built model's layers into quantized ones before quantized weights are loaded.

Three sources: an mlx-community folder's ``quantization`` config key (defaults plus per-layer overrides
keyed by module path, as mlx-lm writes them), GGUF files read by ``mx.load`` and Hugging Face MXFP4
experts (gpt-oss), which carry no such key: there group size and bits come from the shapes of
``.weight`` / ``.scales`` (uint8 scales: MXFP4, groups of 32); and GGUF K-quant
matrices kept as raw blocks (``kquants``), whose layers become the GGUF block layers.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_unflatten

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.metal_kernels.layers import GGUFEmbedding, GGUFLinear


def quantize_to_match(
    model: nn.Module, weights: dict[str, mx.array], quantization: dict[str, Any] | None
) -> None:
    """Quantize, in place, every layer of ``model`` whose ``<path>.scales`` is among ``weights``."""
    if not any(k.endswith(".scales") for k in weights):
        return
    quantization = quantization or {}

    def predicate(path: str, module: nn.Module) -> bool | dict[str, Any]:
        if path in quantization:  # a per-layer override: a dict of parameters, or False to skip
            return quantization[path]
        if not hasattr(module, "to_quantized") or f"{path}.scales" not in weights:
            return False
        if "bits" in quantization and "group_size" in quantization:
            return True
        return _params_from_shapes(path, module, weights)

    nn.quantize(
        model,
        group_size=quantization.get("group_size", 64),
        bits=quantization.get("bits", 4),
        mode=quantization.get("mode", "affine"),
        class_predicate=predicate,
    )


def _params_from_shapes(path: str, module: nn.Module, weights: dict[str, mx.array]) -> dict[str, Any]:
    # A packed uint32 row holds in_features * bits / 32 words; scales hold one value per group.
    # uint8 scales are E8M0 exponents: MXFP4 (gpt-oss's experts, see models/gpt_oss.py).
    if weights[f"{path}.scales"].dtype == mx.uint8:
        return {"group_size": 32, "bits": 4, "mode": "mxfp4"}
    in_features = module.weight.shape[-1]
    packed, scales = weights[f"{path}.weight"], weights[f"{path}.scales"]
    bits = packed.shape[-1] * 32 // in_features
    group_size = in_features // max(scales.shape[-1], 1)
    fits = packed.dtype == mx.uint32 and bits * in_features == packed.shape[-1] * 32
    if not fits or bits not in (2, 3, 4, 5, 6, 8):
        raise InvalidCheckpoint(
            f"{path}: quantized weight {packed.dtype} {tuple(packed.shape)} does not fit {in_features} inputs"
        )
    return {"group_size": group_size, "bits": bits, "mode": "affine"}


def use_gguf_blocks(model: nn.Module, kquants: dict[str, str]) -> None:
    """Replace, in place, the layers at the paths of ``kquants`` (module path -> ``Q4_K``/``Q5_K``/``Q6_K``)
    by layers holding their weight as raw GGUF blocks of that kind."""
    swaps: list[tuple[str, nn.Module]] = []
    for path, module in model.named_modules():
        kind = kquants.get(path)
        if kind is None:
            continue
        if isinstance(module, nn.Linear):
            out_dims, in_dims = module.weight.shape
            swaps.append((path, GGUFLinear(in_dims, out_dims, kind, "bias" in module)))
        elif isinstance(module, nn.Embedding):
            swaps.append((path, GGUFEmbedding(*module.weight.shape, kind)))
        else:
            raise InvalidCheckpoint(f"{path}: {kind} blocks for a {type(module).__name__} are not supported")
    model.update_modules(tree_unflatten(swaps))
