"""Llama, and the architectures that share its layout: Mistral, SmolLM (and, through ``smollm3.py``,
SmolLM3, whose layers choose per layer whether to rotate q and k)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

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
from mlx_infer.models.rope_config import resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    rms_norm_eps: float = 1e-5
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 4096
    rope_theta: float | None = None
    rope_traditional: bool = False
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None  # transformers >= 5 keeps rope_theta here
    tie_word_embeddings: bool = True
    attention_bias: bool = False
    mlp_bias: bool = False
    sliding_window: int | None = None  # Mistral

    default_rope_theta: ClassVar[float] = 10000.0

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, self.default_rope_theta
        )

    def uses_rope(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx`` rotates q and k (False: a NoPE layer)."""
        return True

    def window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx`` (None: full causal attention)."""
        return self.sliding_window


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=args.attention_bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=args.attention_bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=args.attention_bias)
        self.rope_base = args.rope_theta
        self.rope_traditional = args.rope_traditional
        self.rope_scale = rope_scale(args.rope_scaling)
        max_pos = args.max_position_embeddings
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling, None, max_pos)
        self.rope_factor = rope_attention_factor(args.rope_scaling, max_pos)
        self.use_rope = args.uses_rope(layer_idx)
        self.sliding_window = args.window(layer_idx)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.head_dim, self.rope_base, self.rope_traditional, self.rope_scale, self._freqs,
            self.rope_factor,
        )

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q = self.q_proj(x).reshape(n, self.n_heads, self.head_dim)
        k = self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        if self.use_rope:
            q = self.rope(q, meta.positions)
            k = self.rope(k, meta.positions)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int = 0):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size, args.mlp_bias)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = LlamaModel(args)
