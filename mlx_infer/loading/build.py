"""From an HF-style config and HF-named weights to a ready model of the zoo."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.loading.hf import one_line
from mlx_infer.loading.quantized import quantize_to_match, use_gguf_blocks
from mlx_infer.models import model_module
from mlx_infer.models.composite import text_tower_quantization


def build_model(
    config: dict[str, Any],
    weights: dict[str, mx.array],
    source: str,
    kquants: dict[str, str] | None = None,
    module: ModuleType | None = None,
) -> nn.Module:
    """Instantiate the architecture, quantize the layers the checkpoint has quantized, load strictly.

    ``kquants``: module paths whose weights are raw GGUF K-quant blocks (``read_gguf(kquant_blocks=True)``).
    ``module``: the architecture's module, where it is not the decoder registry's (an encoder).
    """
    if "model_type" not in config:
        raise InvalidCheckpoint(f"{source}: config has no model_type")
    module = module or model_module(config["model_type"])
    try:
        model = module.Model(module.ModelArgs.from_dict(config))
    except (TypeError, ValueError, KeyError) as e:
        kind = config["model_type"]
        raise InvalidCheckpoint(f"{source}: config does not fit {kind} ({one_line(e)})") from None
    weights = model.sanitize(weights)
    quantize_to_match(model, weights, text_tower_quantization(config.get("quantization")))
    if kquants:
        use_gguf_blocks(model, kquants)
    _check_dtypes(model, weights, source)
    try:
        model.load_weights(list(weights.items()), strict=True)
    except ValueError as e:
        raise InvalidCheckpoint(f"{source}: {one_line(e)[:300]}") from None
    # The layers' random initial weights, replaced unevaluated, each split MLX's global random key
    # lazily: left so, the key's graph keeps every split of every model built (a server that swaps
    # models grew by about a MiB a load).
    mx.eval(mx.random.state)
    return model


def _check_dtypes(model: nn.Module, weights: dict[str, mx.array], source: str) -> None:
    # load_weights checks names and shapes, not dtypes: an int tensor where a float weight belongs would
    # load silently and give garbage, a float where packed uint32 belongs would fail deep in a matmul.
    for name, expected in tree_flatten(model.parameters()):
        got = weights.get(name)
        if got is None:
            continue
        if mx.issubdtype(expected.dtype, mx.floating):
            ok = mx.issubdtype(got.dtype, mx.floating)
        else:
            ok = got.dtype == expected.dtype
        if not ok:
            want = "a floating type" if mx.issubdtype(expected.dtype, mx.floating) else expected.dtype
            raise InvalidCheckpoint(f"{source}: tensor {name} has dtype {got.dtype}, expected {want}")
