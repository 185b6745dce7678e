"""The text model inside a composite (image-text) checkpoint, under the names a text-only model loads.

Composite checkpoints keep the language model under ``language_model.`` (older transformers and
mlx-lm) or ``model.language_model.`` (transformers >= 4.52), beside vision (and audio) towers that a
text-only model drops.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

# Composite prefix -> text-only prefix; the first that matches a name is used.
TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
VISION_TOWERS = (
    "vision_tower.",
    "multi_modal_projector.",
    "model.vision_tower.",
    "model.multi_modal_projector.",
)


def text_tower(
    weights: dict[str, mx.array],
    dropped: tuple[str, ...] = VISION_TOWERS,
    prefixes: dict[str, str] = TEXT_PREFIXES,
) -> dict[str, mx.array]:
    """The text tower's weights under the text-only names (``model.``, ``lm_head.``), without the
    ``dropped`` towers and RoPE buffers."""
    return {
        text_name(name, prefixes): value
        for name, value in weights.items()
        if not name.startswith(dropped) and "rotary_emb.inv_freq" not in name
    }


def text_name(name: str, prefixes: dict[str, str] = TEXT_PREFIXES) -> str:
    """``name`` (a weight, or a module path such as ``language_model.lm_head``) under the text-only names."""
    prefix = next((p for p in prefixes if f"{name}.".startswith(p)), None)
    return name if prefix is None else (prefixes[prefix] + f"{name}."[len(prefix) :]).removesuffix(".")


def text_tower_quantization(quantization: dict[str, Any] | None) -> dict[str, Any] | None:
    """An mlx-lm ``quantization`` config with its per-layer entries (keyed by module path, as mlx-lm
    writes them for a model that nests the text model, ``language_model.model.layers.0.mlp.down_proj``)
    under the text-only paths the models here have."""
    if quantization is None:
        return None
    # Per-layer entries are dicts (or False); the defaults are plain values under their own keys.
    return {text_name(k) if isinstance(v, (dict, bool)) else k: v for k, v in quantization.items()}
