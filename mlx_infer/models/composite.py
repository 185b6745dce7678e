"""The text model inside a composite (image-text) checkpoint, under the names a text-only model loads.

Composite checkpoints keep the language model under ``language_model.`` (older transformers and
mlx-lm) or ``model.language_model.`` (transformers >= 4.52), beside vision (and audio) towers that a
text-only model drops.
"""

from __future__ import annotations

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
    out = {}
    for name, value in weights.items():
        if name.startswith(dropped) or "rotary_emb.inv_freq" in name:
            continue
        prefix = next((p for p in prefixes if name.startswith(p)), None)
        out[name if prefix is None else prefixes[prefix] + name[len(prefix) :]] = value
    return out
