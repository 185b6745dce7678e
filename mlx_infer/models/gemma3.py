"""Gemma 3 text model (``gemma3_text``; ``gemma3`` multimodal configs run their text tower).

Differences from Llama: sliding-window and global layers with separate RoPE bases, RMSNorm scaling by
``1 + weight``, per-head q/k norms, four norms per block (before and after attention and MLP),
embeddings scaled by ``sqrt(hidden_size)``, a tanh-approximated GELU MLP, the attention scale
``query_pre_attn_scalar ** -0.5`` and optional logit soft-capping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import UnsupportedArchitecture
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
from mlx_infer.models.composite import text_tower
from mlx_infer.models.rope_config import resolve_rope


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Gemma3TextConfig defaults: multimodal configs often omit keys.
    model_type: str = "gemma3_text"
    hidden_size: int = 2304
    num_hidden_layers: int = 26
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    vocab_size: int = 262208
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131072
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_local_base_freq: float | None = None
    rope_parameters: dict[str, Any] | None = None
    query_pre_attn_scalar: float = 256
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list[str] | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        if "text_config" in params:  # Gemma3ForConditionalGeneration: keep only the text tower
            text = params["text_config"]
            params = {**text, "model_type": text.get("model_type", "gemma3_text")}
        return super().from_dict(params)

    def __post_init__(self):
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitecture(
                f"gemma3: hidden_activation {self.hidden_activation!r} is not supported"
            )
        # transformers >= 5 keeps one rope_parameters dict per layer type.
        per_type = self.rope_parameters or {}
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, per_type.get("full_attention"), 1_000_000.0
        )
        self.rope_local_base_freq, self.rope_local_scaling = resolve_rope(
            self.model_type, self.rope_local_base_freq, None, per_type.get("sliding_attention"), 10_000.0
        )
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % self.sliding_window_pattern else "full_attention"
                for i in range(self.num_hidden_layers)
            ]


class RMSNorm(nn.Module):
    """Gemma's RMSNorm: the weight is stored as an offset from one."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.query_pre_attn_scalar**-0.5
        dim = args.hidden_size
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.softcap = args.attn_logit_softcapping
        if args.layer_types[layer_idx] == "sliding_attention":
            self.sliding_window = args.sliding_window
            base, scaling = args.rope_local_base_freq, args.rope_local_scaling
        else:
            self.sliding_window = None
            base, scaling = args.rope_theta, args.rope_scaling
        self.rope_base = base
        self.rope_scale = rope_scale(scaling)
        self._freqs = rope_frequencies(self.head_dim, base, scaling, None, args.max_position_embeddings)
        self.rope_factor = rope_attention_factor(scaling, args.max_position_embeddings)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.head_dim, self.rope_base, False, self.rope_scale, self._freqs, self.rope_factor
        )

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q = self.q_norm(self.q_proj(x).reshape(n, self.n_heads, self.head_dim))
        k = self.k_norm(self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        q = self.rope(q, meta.positions)
        k = self.rope(k, meta.positions)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window, self.softcap)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.gelu_approx(self.gate_proj(x)) * self.up_proj(x))


def residual(x: mx.array, y: mx.array) -> mx.array:
    """``x + y``; in float16 Gemma's activations overflow, so add in float32 and clip to the range."""
    if x.dtype != mx.float16:
        return x + y
    bound = mx.finfo(mx.float16).max
    return mx.clip(x.astype(mx.float32) + y.astype(mx.float32), -bound, bound).astype(mx.float16)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        eps = args.rms_norm_eps
        self.input_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(args.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(args.hidden_size, eps)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        h = residual(x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv, meta)))
        return residual(h, self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h))))


class Gemma3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = Gemma3Model(args)

    def embed(self, tokens: mx.array) -> mx.array:
        return scaled(self.model.embed_tokens(tokens), math.sqrt(self.args.hidden_size))

    def head(self, h: mx.array) -> mx.array:
        return softcap(super().head(h), self.args.final_logit_softcapping)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = text_tower(weights)
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        return out


def scaled(h: mx.array, scale: float) -> mx.array:
    """An embedding times ``scale``: transformers rounds the scale to the weights' dtype first."""
    return h * mx.array(scale, dtype=mx.float32).astype(h.dtype)


def softcap(x: mx.array, cap: float | None) -> mx.array:
    return x if cap is None else mx.tanh(x / cap) * cap
