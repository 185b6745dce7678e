"""FP8 checkpoints (``quantization_config.quant_method == "fp8"``), dequantized at load.

GLM, DeepSeek and Mistral publish their models officially this way: each quantized linear layer stores
``weight`` as float8 e4m3 (which ``mx.load`` returns as raw uint8) and ``weight_scale_inv``, the factor
that brings it back: one per ``weight_block_size`` block (``[128, 128]`` in DeepSeek-V3 style) or one
per tensor (no block size). The product is what transformers' ``_dequantize_fp8_weight`` computes;
static activation scales (``activation_scale`` / ``input_scale``) belong to FP8 activations, which this
engine does not use.

The weights stay lazy: the dequantization is part of the graph that evaluates the parameters.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from mlx_infer.errors import InvalidCheckpoint

_ACTIVATION_SCALES = (".activation_scale", ".input_scale")
_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def is_fp8(config: dict[str, Any]) -> bool:
    quant = config.get("quantization_config") or {}
    return quant.get("quant_method") == "fp8"


def dequantize_fp8(config: dict[str, Any], weights: dict[str, mx.array]) -> dict[str, mx.array]:
    """``weights`` with every FP8 ``weight`` (one that has a ``weight_scale_inv``) dequantized to the
    checkpoint's dtype (``torch_dtype``/``dtype``, bfloat16 by default), scales and activation scales
    dropped. Checkpoints that are not FP8 come back unchanged."""
    if not is_fp8(config):
        return weights
    block = config["quantization_config"].get("weight_block_size")
    text = config.get("text_config", {})
    dtype = _DTYPES.get(config.get("torch_dtype") or config.get("dtype") or text.get("dtype"), mx.bfloat16)
    out = {}
    for name, value in weights.items():
        if name.endswith(("_scale_inv", *_ACTIVATION_SCALES)):
            continue
        scale = weights.get(f"{name}_scale_inv")
        out[name] = value if scale is None else dequantize(value, scale, block, name).astype(dtype)
    return out


def dequantize(weight: mx.array, scale_inv: mx.array, block: list[int] | None, name: str) -> mx.array:
    """float32 ``[..., rows, cols]`` from e4m3 bytes and per-block (``block``) or per-tensor scales."""
    w = mx.from_fp8(weight.view(mx.uint8), dtype=mx.float32)
    scale = scale_inv.astype(mx.float32)
    if block is None or scale.size == 1:
        return w * scale.reshape(())
    rows, cols = w.shape[-2:]
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape[-2:]) != expected:
        raise InvalidCheckpoint(
            f"{name}: weight_scale_inv of shape {tuple(scale.shape)} does not cover a {rows}x{cols} weight "
            f"in {block_rows}x{block_cols} blocks"
        )
    # Each scale spread over its block (the last blocks cut to the weight's edge).
    scale = mx.repeat(mx.repeat(scale, block_rows, axis=-2), block_cols, axis=-1)[..., :rows, :cols]
    return w * scale
