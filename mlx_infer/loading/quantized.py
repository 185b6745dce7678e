"""Turning a freshly built model's layers into quantized ones before quantized weights are loaded.

Two sources: an mlx-community folder's ``quantization`` config key (defaults plus per-layer overrides
keyed by module path, as mlx-lm writes them), and GGUF files read by ``mx.load``, which carry no such
key: there group size and bits come from the shapes of ``.weight`` / ``.scales``.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import InvalidCheckpoint


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
