"""Ministral 3 (``ministral3``, the text model of Mistral 3 / Ministral 3 checkpoints): Mistral's
layout with YaRN RoPE and Llama 4's attention temperature.

The temperature multiplies each query, after RoPE, by ``1 + beta * ln(1 + floor(p / L))`` at position
``p``, with ``beta = llama_4_scaling_beta`` and ``L = original_max_position_embeddings`` of the RoPE
parameters: queries far into a long context are sharpened step by step. Without a beta (plain
Mistral text configs) the layers are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LayerKV
from mlx_infer.models import llama
from mlx_infer.models.base import attention


@dataclass
class ModelArgs(llama.ModelArgs):
    def __post_init__(self):
        if self.head_dim is None and self.model_type == "ministral3":
            self.head_dim = 128  # transformers' Ministral3Config default, independent of hidden_size
        super().__post_init__()
        scaling = self.rope_scaling or {}
        beta = scaling.get("llama_4_scaling_beta")
        length = scaling.get("original_max_position_embeddings")
        # (beta, L) of the query temperature, or None.
        self.query_temperature = None if beta is None else (float(beta), int(length))


def query_temperature(positions: mx.array, beta: float, length: int) -> mx.array:
    """``[T]`` positions -> ``[T, 1, 1]`` factors, in float32 as transformers computes them."""
    steps = mx.floor(positions.astype(mx.float32) / length)
    return (1.0 + beta * mx.log(1.0 + steps))[:, None, None]


class Attention(llama.Attention):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__(args, layer_idx)
        self.beta, self.length = args.query_temperature

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        q = self.rope(q, meta.positions)
        k = self.rope(k, meta.positions)
        q = q * query_temperature(meta.positions, self.beta, self.length).astype(q.dtype)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class Model(llama.Model):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        if args.query_temperature is not None:
            for i, layer in enumerate(self.layers):
                layer.self_attn = Attention(args, i)
