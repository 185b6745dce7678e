"""Phi-3 / Phi-3.5 / Phi-4-mini: Llama-like blocks with fused ``qkv_proj`` and ``gate_up_proj``.

RoPE may rotate only the first ``partial_rotary_factor`` of each head. The long-context ``su`` /
``longrope`` scaling always uses its ``long_factor``, as vLLM and mlx-lm do: transformers switches to the
short factors while a sequence is shorter than ``original_max_position_embeddings``, which would make a
sequence's RoPE depend on how far it has grown, so logits differ from transformers' there.
"""

from __future__ import annotations

import math
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
from mlx_infer.models.rope_config import SUPPORTED_SCALING, resolve_rope, scaling_type

_LONGROPE = ("longrope", "su")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    original_max_position_embeddings: int = 4096
    sliding_window: int | None = None  # transformers' Phi3Attention applies it to every layer
    tie_word_embeddings: bool = False

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type,
            self.rope_theta,
            self.rope_scaling,
            self.rope_parameters,
            10000.0,
            SUPPORTED_SCALING + _LONGROPE,
        )

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


def longrope(args: ModelArgs) -> tuple[mx.array, float]:
    """LongRoPE's ``mx.fast.rope`` frequencies (long factors) and its attention factor, which scales the
    rotated features (transformers multiplies cos and sin by it)."""
    scaling = args.rope_scaling
    dims = args.rope_dims
    freqs = mx.array(scaling["long_factor"], dtype=mx.float32) * args.rope_theta ** (
        mx.arange(0, dims, 2, dtype=mx.float32) / dims
    )
    factor = scaling.get("attention_factor")
    if factor is None:
        original = args.original_max_position_embeddings
        ratio = args.max_position_embeddings / original
        factor = 1.0 if ratio <= 1.0 else math.sqrt(1 + math.log(ratio) / math.log(original))
    return freqs, float(factor)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim = args.hidden_size
        self.qkv_proj = nn.Linear(dim, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=False)
        self.rope_dims = args.rope_dims
        self.rope_base = args.rope_theta
        self.rope_scale = rope_scale(args.rope_scaling)
        self._feature_scale = None
        self.rope_factor = rope_attention_factor(args.rope_scaling, args.max_position_embeddings)
        if scaling_type(args.rope_scaling) in _LONGROPE:
            self._freqs, factor = longrope(args)
            self._feature_scale = mx.array(
                [factor] * self.rope_dims + [1.0] * (self.head_dim - self.rope_dims), dtype=mx.float32
            )
        else:
            scaling, max_pos = args.rope_scaling, args.max_position_embeddings
            self._freqs = rope_frequencies(self.head_dim, args.rope_theta, scaling, self.rope_dims, max_pos)
        self.sliding_window = args.sliding_window

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        if self._feature_scale is not None:
            x = x * self._feature_scale.astype(x.dtype)
        return apply_rope(
            x, positions, self.rope_dims, self.rope_base, False, self.rope_scale, self._freqs,
            self.rope_factor,
        )

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q_end = self.n_heads * self.head_dim
        k_end = q_end + self.n_kv_heads * self.head_dim
        q, k, v = mx.split(self.qkv_proj(x), [q_end, k_end], axis=-1)
        q = self.rope(q.reshape(n, self.n_heads, self.head_dim), meta.positions)
        k = self.rope(k.reshape(n, self.n_kv_heads, self.head_dim), meta.positions)
        v = v.reshape(n, self.n_kv_heads, self.head_dim)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(dim, 2 * hidden_dim, bias=False)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x), 2, axis=-1)
        return self.down_proj(nn.silu(gate) * up)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class Phi3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args) for _ in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = Phi3Model(args)
