"""The names and config mlx-lm reads where its model nests the text model in a composite.

mlx-lm's ``mistral3`` keeps the text model as ``language_model`` and builds it from ``text_config`` alone:
its per-layer quantization entries are looked up under ``language_model.``-prefixed module paths, and the
head is tied by ``text_config.tie_word_embeddings`` (not the composite's flag, which transformers 5 and
mlx-infer follow). The output therefore names weights and per-layer entries as mlx-lm saves such a model
and records the tie the converted model has in ``text_config``; mlx-infer's loader reads both forms.
(mlx-lm's ministral3 slides a window only on layers ``layer_types`` names and needs one full-attention
layer, so a config whose ``sliding_window`` slides every layer, as transformers reads it, differs there
past the window.)
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from .weights import Group

# model_type -> the prefix mlx-lm's model puts before the text model's own names.
NESTED_TEXT_MODEL = {"mistral3": "language_model."}


def prefix(config: dict[str, Any]) -> str:
    return NESTED_TEXT_MODEL.get(config.get("model_type", ""), "")


def rename_groups(groups: list[Group], config: dict[str, Any]) -> None:
    """Prefix every output tensor's name, in place."""
    if p := prefix(config):
        for g in groups:
            g.tensors = {p + name: value for name, value in g.tensors.items()}


Config = dict[str, Any]


def mlx_lm_config(
    config: Config, quantization: Config | None, model: nn.Module
) -> tuple[Config, Config | None]:
    """(the source config, the quantization key) as mlx-lm reads them for this model type."""
    p = prefix(config)
    if not p:
        return config, quantization
    text = {**config["text_config"], "tie_word_embeddings": model.args.tie_word_embeddings}
    if quantization is not None:
        quantization = {p + k if isinstance(v, dict) else k: v for k, v in quantization.items()}
    return {**config, "text_config": text}, quantization
