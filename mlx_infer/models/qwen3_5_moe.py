"""Qwen3.5 / Qwen3.6 MoE (e.g. 35B-A3B): Qwen3.5 with every MLP a routed mixture of experts plus a shared
expert (top-k probabilities always renormalised). ``qwen3_5_moe`` is the image-text checkpoint,
``qwen3_5_moe_text`` the text model alone."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.nn as nn

from mlx_infer.models import qwen3_5, qwen3_next


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    num_experts: int = 256
    num_experts_per_tok: int = 8

    def __post_init__(self):
        super().__post_init__()
        self.norm_topk_prob = True
        self.decoder_sparse_step = 1
        self.mlp_only_layers = []


class Model(qwen3_5.Model):
    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        return qwen3_next.SparseMoeBlock(args)
