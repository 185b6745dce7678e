"""Mistral 3 (``Mistral3ForConditionalGeneration``: Mistral Small 3.x, Ministral 3): the text model only.

The config nests the language model under ``text_config`` (``mistral``, or ``ministral3`` with YaRN and
the query temperature; both are :mod:`ministral3`'s layers); the vision tower and the projector are
dropped at load. Checkpoints name the text weights ``language_model.model.*`` (what ``save_pretrained``
writes) or ``model.language_model.*`` (transformers 5 in memory).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.models import ministral3
from mlx_infer.models.composite import text_tower


@dataclass
class ModelArgs(ministral3.ModelArgs):
    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        text = params.get("text_config", params)
        # transformers 5 ties the head by the composite's flag when it has one (its default, True, also
        # holds when the checkpoint has no lm_head); older configs carry only the text model's.
        tie = params.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        return super().from_dict(
            {**text, "model_type": text.get("model_type", "mistral"), "tie_word_embeddings": tie}
        )


class Model(ministral3.Model):
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = text_tower(weights)
        if self.args.tie_word_embeddings and "lm_head.weight" in out:
            # A head the checkpoint has is used, as transformers does when the composite's flag (True by
            # default, so also in configs that never set it) says tied but both tensors are stored.
            self.args.tie_word_embeddings = False
            self.lm_head = nn.Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        return super().sanitize(out)
