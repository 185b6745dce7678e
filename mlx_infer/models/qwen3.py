"""Qwen3 (dense): Qwen2's layout with an RMSNorm over each head of q and k, and no q/k/v bias."""

from __future__ import annotations

from dataclasses import dataclass

from mlx_infer.models import qwen2
from mlx_infer.models.llama import MLP


@dataclass
class ModelArgs(qwen2.ModelArgs):
    head_dim: int | None = 128  # transformers' Qwen3Config default, independent of hidden_size
    attention_bias: bool = False


class Model(qwen2.Model):
    def make_block(self, args: ModelArgs, layer_idx: int) -> qwen2.TransformerBlock:
        return qwen2.TransformerBlock(
            args, self.make_attention(args, layer_idx), MLP(args.hidden_size, args.intermediate_size)
        )

    @staticmethod
    def make_attention(args: ModelArgs, layer_idx: int) -> qwen2.Attention:
        bias = args.attention_bias
        return qwen2.Attention(args, layer_idx, qkv_bias=bias, o_bias=bias, qk_norm=True)
