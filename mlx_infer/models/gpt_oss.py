"""gpt-oss (OpenAI's gpt-oss-20b / gpt-oss-120b).

Differences from Llama: attention with biases and a learned sink logit per head (``sinks``, joining
every softmax's denominator), sliding-window and full-attention layers alternating, and every MLP a
mixture of experts: a router (linear with bias) picks the top-k experts by logit, a softmax over
those k weighs them, and each expert is a clamped SwiGLU with biases (``(up + 1) * gate *
sigmoid(alpha * gate)``, gate clamped above and up on both sides at ``limit``).

Hugging Face stores the experts stacked as ``mlp.experts.gate_up_proj`` ``[E, in, 2 * I]`` with gate
and up interleaved along the last axis (``[..., ::2]`` / ``[..., 1::2]``) and ``down_proj`` ``[E, I,
in]``, each with a ``_bias``; the official checkpoints instead hold them as MXFP4, ``*_blocks``
(uint8 ``[E, out, in / 32, 16]``: two 4-bit values a byte, low nibble first, 32 a group) and
``*_scales`` (uint8 ``[E, out, in / 32]``: E8M0 exponents). :meth:`Model.sanitize` turns both into
mlx-lm's ``mlp.experts.{gate,up,down}_proj.{weight,bias}``; MXFP4 blocks become MLX's own ``mxfp4``
quantization (the same bits: packed words and exponents, nothing dequantized), which the loader
recognises by its uint8 scales.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import InvalidCheckpoint
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
from mlx_infer.models.qwen3_moe import SwitchGLU
from mlx_infer.models.rope_config import resolve_rope
from mlx_infer.models.routing import top_k_experts


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' GptOssConfig defaults (gpt-oss-20b).
    model_type: str = "gpt_oss"
    hidden_size: int = 2880
    num_hidden_layers: int = 24
    intermediate_size: int = 2880
    num_attention_heads: int = 64
    num_key_value_heads: int = 8
    head_dim: int = 64
    vocab_size: int = 201088
    rms_norm_eps: float = 1e-5
    num_local_experts: int = 128
    num_experts_per_tok: int = 4
    sliding_window: int = 128
    layer_types: list[str] | None = None
    max_position_embeddings: int = 131072
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_bias: bool = True
    tie_word_embeddings: bool = False

    def __post_init__(self):
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, 150000.0
        )
        if self.layer_types is None:  # transformers' default: sliding first, then every other layer
            self.layer_types = [
                "sliding_attention" if i % 2 == 0 else "full_attention" for i in range(self.num_hidden_layers)
            ]


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.sinks = mx.zeros((self.n_heads,))
        sliding = args.layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = args.sliding_window if sliding else None
        # Real checkpoints: YaRN, factor 32 over a 4096-token original context, truncate false.
        self.rope_base = args.rope_theta
        self.rope_scale = rope_scale(args.rope_scaling)
        max_pos = args.max_position_embeddings
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling, None, max_pos)
        self.rope_factor = rope_attention_factor(args.rope_scaling, max_pos)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.head_dim, self.rope_base, False, self.rope_scale, self._freqs, self.rope_factor
        )

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q = self.rope(self.q_proj(x).reshape(n, self.n_heads, self.head_dim), meta.positions)
        k = self.rope(self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim), meta.positions)
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        out = attention(q, k, v, kv, meta, self.scale, self.sliding_window, sinks=self.sinks)
        return self.o_proj(out.reshape(n, -1))


def clamped_swiglu(alpha: float, limit: float):
    """gpt-oss's expert activation of (gate, up)."""

    def activation(gate: mx.array, up: mx.array) -> mx.array:
        gate = mx.minimum(gate, limit)
        up = mx.clip(up, -limit, limit)
        return (up + 1) * (gate * mx.sigmoid(alpha * gate))

    return activation


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.router = nn.Linear(args.hidden_size, args.num_local_experts, bias=True)
        self.experts = SwitchGLU(
            args.hidden_size, args.intermediate_size, args.num_local_experts, bias=True,
            activation=clamped_swiglu(args.swiglu_alpha, args.swiglu_limit),
        )

    def __call__(self, x: mx.array) -> mx.array:
        logits = self.router(x).astype(mx.float32)
        k = self.top_k
        inds = top_k_experts(logits, k)
        # The softmax is over the chosen experts' logits only (not renormalised probabilities).
        scores = mx.softmax(mx.take_along_axis(logits, inds, axis=-1), axis=-1)
        y = self.experts(x, inds)
        return (y * scores[..., None].astype(y.dtype)).sum(axis=-2)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args, layer_idx)
        self.mlp = MoE(args)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class GptOssModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [TransformerBlock(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = GptOssModel(args)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        # GGUF files name the sinks like a module's weight.
        weights = {k.removesuffix(".sinks.weight") + ".sinks" if k.endswith(".sinks.weight") else k: v
                   for k, v in weights.items()}
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}.mlp.experts"
            if f"{prefix}.gate_up_proj_blocks" in weights:
                _split_mxfp4(weights, prefix)
            elif f"{prefix}.gate_up_proj" in weights:
                _split_float(weights, prefix)
            for name, half in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                if f"{prefix}.gate_up_proj_bias" in weights:
                    weights[f"{prefix}.{name}.bias"] = weights[f"{prefix}.gate_up_proj_bias"][..., half]
            if f"{prefix}.down_proj_bias" in weights:
                weights[f"{prefix}.down_proj.bias"] = weights.pop(f"{prefix}.down_proj_bias")
            weights.pop(f"{prefix}.gate_up_proj_bias", None)
        return weights


def _split_float(weights: dict[str, mx.array], prefix: str) -> None:
    """``gate_up_proj`` [E, in, 2I] (interleaved) and ``down_proj`` [E, I, in] -> ``[E, out, in]`` each."""
    gate_up = weights.pop(f"{prefix}.gate_up_proj")
    weights[f"{prefix}.gate_proj.weight"] = gate_up[..., ::2].swapaxes(-1, -2)
    weights[f"{prefix}.up_proj.weight"] = gate_up[..., 1::2].swapaxes(-1, -2)
    weights[f"{prefix}.down_proj.weight"] = weights.pop(f"{prefix}.down_proj").swapaxes(-1, -2)


def _split_mxfp4(weights: dict[str, mx.array], prefix: str) -> None:
    """MXFP4 ``*_blocks`` / ``*_scales`` -> MLX ``mxfp4`` packed weights and scales of each projection.

    A row's bytes hold its values in order, two a byte with the low nibble first: read as little-endian
    uint32 words they are exactly MLX's packing (eight 4-bit values a word, lowest bits first), and one
    E8M0 exponent per 32 values is MLX's ``mxfp4`` scale.
    """

    def packed(name: str, rows: slice) -> tuple[mx.array, mx.array]:
        blocks, scales = weights[f"{prefix}.{name}_blocks"], weights[f"{prefix}.{name}_scales"]
        if blocks.dtype != mx.uint8 or blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.dtype != mx.uint8:
            raise InvalidCheckpoint(f"{prefix}.{name}_blocks: not MXFP4 blocks (uint8 [E, out, in / 32, 16])")
        blocks, scales = blocks[:, rows], scales[:, rows]
        words = mx.contiguous(blocks.reshape(*blocks.shape[:2], -1)).view(mx.uint32)
        return words, mx.contiguous(scales)

    for name, source, rows in (
        ("gate_proj", "gate_up_proj", slice(0, None, 2)),
        ("up_proj", "gate_up_proj", slice(1, None, 2)),
        ("down_proj", "down_proj", slice(None)),
    ):
        weights[f"{prefix}.{name}.weight"], weights[f"{prefix}.{name}.scales"] = packed(source, rows)
    for source in ("gate_up_proj", "down_proj"):
        del weights[f"{prefix}.{source}_blocks"], weights[f"{prefix}.{source}_scales"]
