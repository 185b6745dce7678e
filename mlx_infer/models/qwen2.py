"""Qwen2 / Qwen2.5: the Llama layout with biases on the q/k/v projections.

Also the base of ``qwen3`` and ``qwen3_moe``, which change the attention (per-head q/k RMSNorm) and the
MLP (mixture of experts) through :meth:`Model.make_block`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LayerKV
from mlx_infer.models.base import (
    BaseModelArgs,
    CausalLM,
    apply_rope,
    attention,
    rope_attention_factor,
    rope_frequencies,
    rope_scale,
)
from mlx_infer.models.llama import MLP
from mlx_infer.models.rope_config import resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    tie_word_embeddings: bool = False
    # Qwen's sliding window applies only when enabled, and only from layer max_window_layers on.
    use_sliding_window: bool = False
    sliding_window: int | None = None
    max_window_layers: int = 28
    layer_types: list[str] | None = None

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, 10000.0
        )
        if self.layer_types is None:
            sliding = self.use_sliding_window and self.sliding_window is not None
            self.layer_types = [
                "sliding_attention" if sliding and i >= self.max_window_layers else "full_attention"
                for i in range(self.num_hidden_layers)
            ]

    def window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full causal attention)."""
        return self.sliding_window if self.layer_types[layer_idx] == "sliding_attention" else None


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, *, qkv_bias: bool, o_bias: bool, qk_norm: bool):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=qkv_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=o_bias)
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
            self.k_norm = nn.RMSNorm(self.head_dim, eps=args.rms_norm_eps)
        self.qk_norm = qk_norm
        self.rope_base = args.rope_theta
        self.rope_scale = rope_scale(args.rope_scaling)
        max_pos = args.max_position_embeddings
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling, None, max_pos)
        self.rope_factor = rope_attention_factor(args.rope_scaling, max_pos)
        self.sliding_window = args.window(layer_idx)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.head_dim, self.rope_base, False, self.rope_scale, self._freqs, self.rope_factor
        )

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = self.rope(q, meta.positions)
        k = self.rope(k, meta.positions)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, self_attn: Attention, mlp: nn.Module):
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class QwenModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[TransformerBlock]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = QwenModel(args, [self.make_block(args, i) for i in range(args.num_hidden_layers)])

    def make_block(self, args: ModelArgs, layer_idx: int) -> TransformerBlock:
        attn = Attention(args, layer_idx, qkv_bias=True, o_bias=False, qk_norm=False)
        return TransformerBlock(args, attn, MLP(args.hidden_size, args.intermediate_size))
