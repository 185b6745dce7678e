"""Qwen3.5 / Qwen3.6 (dense): Qwen3-Next's hybrid layout with separate DeltaNet input projections.

``qwen3_5`` configs are image-text checkpoints (``Qwen3_5ForConditionalGeneration``): the text model is
``text_config`` and its weights ``model.language_model.*``; the vision tower is dropped. ``qwen3_5_text``
is the text model alone. Text positions are the same on MRoPE's three axes, where MRoPE is plain RoPE.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.models import qwen3_next
from mlx_infer.models.composite import text_tower

# What a text-only model drops from image-text checkpoints (and the multi-token-prediction layer).
_DROPPED_PREFIXES = ("model.visual.", "visual.", "vision_tower.", "mtp.")


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        if "text_config" in params:  # image-text checkpoint: keep only the text model
            text = params["text_config"]
            params = {"tie_word_embeddings": params.get("tie_word_embeddings", False), **text}
            params["model_type"] = text.get("model_type", "qwen3_5_text")
        return super().from_dict(params)


class GatedDeltaNet(qwen3_next.GatedDeltaNet):
    fused_projections = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),)

    def make_projections(self, args: ModelArgs) -> None:
        d = args.hidden_size
        self.in_proj_qkv = nn.Linear(d, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(d, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(d, self.num_v_heads, bias=False)
        self.in_proj_a = nn.Linear(d, self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        z = self.in_proj_z(x).reshape(x.shape[0], self.num_v_heads, self.head_v_dim)
        return self.in_proj_qkv(x), z, self.in_proj_b(x), self.in_proj_a(x)


class Model(qwen3_next.Model):
    linear_attention_class = GatedDeltaNet

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = text_tower(weights, _DROPPED_PREFIXES)
        return super().sanitize(out)
