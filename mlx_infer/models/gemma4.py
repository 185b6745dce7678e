"""Gemma 4 text model (``gemma4_text``; ``gemma4`` multimodal configs run their text tower).

What differs from Gemma 3 (whose MLP, residual and text-tower renaming it reuses):

- RMSNorm multiplies by its weight (not ``1 + weight``); values are RMS-normalised too (no weight);
  the attention scale is 1 (the q/k norms set the scale).
- Global (``full_attention``) layers may have their own head size and KV head count
  (``global_head_dim``, ``num_global_key_value_heads`` or transformers' ``per_layer_config``), keys
  doubling as values (``attention_k_eq_v``: values are the raw key projection), and *proportional*
  RoPE: only the first ``partial_rotary_factor`` of the frequency pairs rotate, with exponents over the
  whole head size.
- KV sharing: the last ``num_kv_shared_layers`` layers compute queries only and attend over the K/V
  of the last earlier layer of their type (:meth:`ModelArgs.kv_source`); they write nothing. Their
  MLP is twice as wide with ``use_double_wide_mlp``.
- Per-layer inputs ("PLE"): each layer gets a small vector per token, from its own slice of a
  per-layer embedding table plus a projection of the token's embedding, and gates it into the
  residual stream after the MLP.
- Optionally (26B-A4B) a dense MLP plus routed GELU experts in every layer, each with its own norms.
- A learned scalar multiplies each layer's output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import UnsupportedArchitecture
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import KVSpec, LayerKV
from mlx_infer.models.base import BaseModelArgs, CausalLM, apply_rope, attention
from mlx_infer.models.composite import text_tower
from mlx_infer.models.gemma3 import MLP, residual, scaled, softcap
from mlx_infer.models.qwen3_moe import SwitchGLU
from mlx_infer.models.rope_config import resolve_rope, scaling_type
from mlx_infer.models.routing import top_k_experts

_DROPPED_PREFIXES = (
    "vision_tower.",
    "audio_tower.",
    "embed_vision.",
    "embed_audio.",
    "model.vision_tower.",
    "model.audio_tower.",
    "model.embed_vision.",
    "model.embed_audio.",
)
# Weights a KV-shared layer may carry in a checkpoint (mlx-lm's conversions do) but never uses
# (transformers ignores them too).
_UNUSED_IN_SHARED = ("k_proj", "v_proj", "k_norm", "v_norm")
_ROPE_TYPES = ("default", "proportional")
_DEFAULT_ROPE = {
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
    "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0},
}


@dataclass
class ModelArgs(BaseModelArgs):
    # Defaults are transformers' Gemma4TextConfig defaults: configs may omit keys.
    model_type: str = "gemma4_text"
    hidden_size: int = 2304
    num_hidden_layers: int = 30
    intermediate_size: int = 9216
    num_attention_heads: int = 8
    num_key_value_heads: int = 4
    head_dim: int = 256
    global_head_dim: int = 512
    num_global_key_value_heads: int | None = None
    per_layer_config: dict[str, dict[str, Any]] | None = None
    vocab_size: int = 262_144
    rms_norm_eps: float = 1e-6
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 131_072
    rope_parameters: dict[str, Any] | None = None
    attention_bias: bool = False
    sliding_window: int = 512
    layer_types: list[str] | None = None
    final_logit_softcapping: float | None = None
    use_bidirectional_attention: str | None = None
    vocab_size_per_layer_input: int = 262_144
    hidden_size_per_layer_input: int = 256
    attention_k_eq_v: bool = False
    num_kv_shared_layers: int = 0
    enable_moe_block: bool = False
    use_double_wide_mlp: bool = False
    num_experts: int | None = None
    top_k_experts: int | None = None
    moe_intermediate_size: int | None = None
    pad_token_id: int | None = 0
    tie_word_embeddings: bool = True

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        if "text_config" in params:  # Gemma4ForConditionalGeneration: keep only the text tower
            text = params["text_config"]
            params = {**text, "model_type": text.get("model_type", "gemma4_text")}
        return super().from_dict(params)

    def __post_init__(self):
        if self.hidden_activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise UnsupportedArchitecture(
                f"gemma4: hidden_activation {self.hidden_activation!r} is not supported"
            )
        if self.use_bidirectional_attention == "all":
            raise UnsupportedArchitecture("gemma4: bidirectional attention (an encoder) is not supported")
        if self.layer_types is None:
            self.layer_types = [
                "sliding_attention" if (i + 1) % 6 else "full_attention"
                for i in range(self.num_hidden_layers)
            ]
        # transformers forces the last layer global, whatever the config says.
        self.layer_types = [*self.layer_types[:-1], "full_attention"]
        self.rope_parameters = self.rope_parameters or _DEFAULT_ROPE
        for kind in set(self.layer_types):
            params = self.rope_parameters.get(kind)
            if not params or "rope_theta" not in params:
                raise UnsupportedArchitecture(
                    f"gemma4: rope_parameters gives no rope_theta for {kind!r} layers"
                )
            resolve_rope(self.model_type, None, None, params, 10_000.0, _ROPE_TYPES)  # refuses other types
        if self.num_kv_shared_layers >= self.num_hidden_layers:
            raise UnsupportedArchitecture("gemma4: every layer shares K/V, so no layer computes any")
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if set(self.layer_types[first_shared:]) - set(self.layer_types[:first_shared]):
            raise UnsupportedArchitecture("gemma4: a KV-shared layer type has no earlier layer to read from")
        if self.enable_moe_block and not (
            self.num_experts and self.top_k_experts and self.moe_intermediate_size
        ):
            raise UnsupportedArchitecture(
                "gemma4: enable_moe_block needs num_experts, top_k_experts, moe_intermediate_size"
            )

    def is_sliding(self, layer: int) -> bool:
        return self.layer_types[layer] == "sliding_attention"

    def layer_kv_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head size) of ``layer``, as transformers' ``per_layer_config`` resolves them."""
        if self.per_layer_config is not None:
            over = {int(k): v for k, v in self.per_layer_config.items()}.get(layer, {})
            kv_heads = over.get("num_key_value_heads", self.num_key_value_heads)
            return kv_heads, over.get("head_dim", self.head_dim)
        if self.is_sliding(layer):
            return self.num_key_value_heads, self.head_dim
        global_kv = self.num_global_key_value_heads if self.attention_k_eq_v else None
        return global_kv or self.num_key_value_heads, self.global_head_dim

    def kv_source(self, layer: int) -> int | None:
        """The layer whose K/V ``layer`` reads (the last non-shared one of its type), or None when it
        computes its own."""
        first_shared = self.num_hidden_layers - self.num_kv_shared_layers
        if layer < first_shared:
            return None
        kind = self.layer_types[layer]
        return max(j for j in range(first_shared) if self.layer_types[j] == kind)


def rope_pairs(head_dim: int, params: dict[str, Any]) -> tuple[int, mx.array | None]:
    """(pairs that rotate, their ``mx.fast.rope`` frequencies) of a layer type's RoPE; None for the
    frequencies of plain RoPE. Proportional RoPE rotates the first ``partial_rotary_factor`` of the
    ``head_dim / 2`` pairs (dimension ``i`` with ``i + head_dim / 2``), with exponents over the whole
    ``head_dim``; the other pairs stay as they are (transformers gives them frequency 0)."""
    if scaling_type(params) != "proportional":
        return head_dim // 2, None
    angles = int(params.get("partial_rotary_factor", 1.0) * head_dim // 2)
    exponents = mx.arange(0, 2 * angles, 2, dtype=mx.float32) / head_dim
    return angles, params.get("factor", 1.0) * params["rope_theta"] ** exponents


def last_rows_only(meta: BatchMetadata) -> BatchMetadata | None:
    """``meta`` cut to each sequence's last row, when those are the only rows whose logits it wants
    (one per sequence); None when it wants every row or several rows of a sequence (verification)."""
    rows = meta.logits_index
    if rows is None or rows.shape[0] != meta.batch_size:
        return None
    positions = meta.positions[rows]
    return replace(
        meta,
        positions=positions,
        slot_mapping=meta.slot_mapping[rows],
        query_lens=(1,) * meta.batch_size,
        q_pad_index=None,
        q_unpad_index=None,
        q_positions=positions[:, None],
        logits_index=None,
        windowed=None if meta.windowed is None else last_rows_only(meta.windowed),
    )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads, self.head_dim = args.layer_kv_shape(layer_idx)
        self.eps = args.rms_norm_eps
        self.sliding_window = args.sliding_window if args.is_sliding(layer_idx) else None
        self.shared = args.kv_source(layer_idx) is not None
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, self.n_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, self.eps)
        if not self.shared:
            self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
            if not (args.attention_k_eq_v and not args.is_sliding(layer_idx)):
                self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
            self.k_norm = nn.RMSNorm(self.head_dim, self.eps)
        params = args.rope_parameters[args.layer_types[layer_idx]]
        self.rope_base = float(params["rope_theta"])
        self.rope_pairs, self._freqs = rope_pairs(self.head_dim, params)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        n, half = self.rope_pairs, self.head_dim // 2
        if n == half:
            return apply_rope(x, positions, self.head_dim, self.rope_base, False, 1.0, self._freqs)
        if n == 0:
            return x
        # Only the rotating pairs go through RoPE (a zero frequency is not one mx.fast.rope takes).
        pairs = mx.concatenate([x[..., :n], x[..., half : half + n]], axis=-1)
        r = apply_rope(pairs, positions, 2 * n, self.rope_base, False, 1.0, self._freqs)
        return mx.concatenate([r[..., :n], x[..., n:half], r[..., n:], x[..., half + n :]], axis=-1)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        """``kv``: this layer's pool, or for a shared layer its source's, which it only reads."""
        n = x.shape[0]
        q = self.rope(self.q_norm(self.q_proj(x).reshape(n, self.n_heads, self.head_dim)), meta.positions)
        if self.shared:
            from mlx_infer.metal_kernels.dispatch import paged_attention

            pages = meta.pages(kv.windowed)
            out = paged_attention(q, kv.keys, kv.values, pages, 1.0, self.sliding_window, None)
        else:
            k = self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
            v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim) if "v_proj" in self else k
            k = self.rope(self.k_norm(k), meta.positions)
            v = mx.fast.rms_norm(v, None, self.eps)
            out = attention(q, k, v, kv, meta, 1.0, self.sliding_window)
        return self.o_proj(out.reshape(n, -1))


class Router(nn.Module):
    """Top-k of a softmax over the experts, renormalised, times a learned scale per expert."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.eps = args.rms_norm_eps
        self.top_k = args.top_k_experts
        self.root = args.hidden_size**-0.5
        self.proj = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.scale = mx.ones((args.hidden_size,))
        self.per_expert_scale = mx.ones((args.num_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        h = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        # In float32, as transformers computes the router, whatever the weights' dtype.
        probs = mx.softmax(self.proj(h).astype(mx.float32), axis=-1)
        inds = top_k_experts(probs, self.top_k)
        weights = mx.take_along_axis(probs, inds, axis=-1)
        weights = weights / weights.sum(axis=-1, keepdims=True) * self.per_expert_scale[inds]
        return inds, weights


def geglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.gelu_approx(gate) * up


class Experts(nn.Module):
    """GELU-gated experts, stacked as mlx-lm stores them (``switch_glu.{gate,up,down}_proj``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.switch_glu = SwitchGLU(
            args.hidden_size, args.moe_intermediate_size, args.num_experts, activation=geglu
        )

    def __call__(self, x: mx.array, inds: mx.array, weights: mx.array) -> mx.array:
        y = self.switch_glu(x, inds)
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        dim, eps = args.hidden_size, args.rms_norm_eps
        self.self_attn = Attention(args, layer_idx)
        wide = args.use_double_wide_mlp and args.kv_source(layer_idx) is not None
        self.mlp = MLP(dim, args.intermediate_size * (2 if wide else 1))
        self.input_layernorm = nn.RMSNorm(dim, eps)
        self.post_attention_layernorm = nn.RMSNorm(dim, eps)
        self.pre_feedforward_layernorm = nn.RMSNorm(dim, eps)
        self.post_feedforward_layernorm = nn.RMSNorm(dim, eps)
        if args.enable_moe_block:
            self.router = Router(args)
            self.experts = Experts(args)
            self.post_feedforward_layernorm_1 = nn.RMSNorm(dim, eps)
            self.post_feedforward_layernorm_2 = nn.RMSNorm(dim, eps)
            self.pre_feedforward_layernorm_2 = nn.RMSNorm(dim, eps)
        self.per_layer = bool(args.hidden_size_per_layer_input)
        if self.per_layer:
            self.per_layer_input_gate = nn.Linear(dim, args.hidden_size_per_layer_input, bias=False)
            self.per_layer_projection = nn.Linear(args.hidden_size_per_layer_input, dim, bias=False)
            self.post_per_layer_input_norm = nn.RMSNorm(dim, eps)
        self.layer_scalar = mx.ones((1,))

    def feed_forward(self, h: mx.array) -> mx.array:
        out = self.mlp(self.pre_feedforward_layernorm(h))
        if "router" in self:
            # The experts see the block's input (not the dense MLP's norm), and each branch has its norm.
            inds, weights = self.router(h)
            experts = self.experts(self.pre_feedforward_layernorm_2(h), inds, weights)
            out = self.post_feedforward_layernorm_1(out) + self.post_feedforward_layernorm_2(experts)
        return self.post_feedforward_layernorm(out)

    def __call__(
        self, x: mx.array, kv: LayerKV, meta: BatchMetadata, per_layer_input: mx.array | None = None
    ) -> mx.array:
        h = residual(x, self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), kv, meta)))
        h = residual(h, self.feed_forward(h))
        if self.per_layer:
            if per_layer_input is None:
                raise UnsupportedArchitecture(
                    "gemma4: a layer with per-layer inputs was run alone; run the whole model"
                )
            gate = nn.gelu_approx(self.per_layer_input_gate(h)) * per_layer_input
            h = residual(h, self.post_per_layer_input_norm(self.per_layer_projection(gate)))
        return h * self.layer_scalar


class Gemma4Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, args.rms_norm_eps)
        if args.hidden_size_per_layer_input:
            per_layer = args.num_hidden_layers * args.hidden_size_per_layer_input
            self.embed_tokens_per_layer = nn.Embedding(args.vocab_size_per_layer_input, per_layer)
            self.per_layer_model_projection = nn.Linear(args.hidden_size, per_layer, bias=False)
            self.per_layer_projection_norm = nn.RMSNorm(args.hidden_size_per_layer_input, args.rms_norm_eps)


class Model(CausalLM):
    # The per-layer embedding (E2B: 262144 x 35 x 256, 4.7 GB in bfloat16) is only gathered.
    row_tables = ("model.embed_tokens_per_layer.weight",)

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = Gemma4Model(args)
        # Layer i attends over cache[kv_sources[i]]: its own pool, or its source's.
        self.kv_sources = [
            i if (source := args.kv_source(i)) is None else source for i in range(args.num_hidden_layers)
        ]

    @property
    def needs_per_layer_inputs(self) -> bool:
        """Whether its layers take per-layer inputs beside the hidden state, so that they cannot run
        one by one from the hidden state alone (as a pipeline stage runs them)."""
        return bool(self.args.hidden_size_per_layer_input)

    def kv_layout(self) -> list[KVSpec]:
        """Global layers' pools may be wider than sliding ones'; a KV-shared layer owns none."""
        args = self.args

        def window(j: int) -> int | None:
            return args.sliding_window if args.is_sliding(j) else None

        return [
            KVSpec(*args.layer_kv_shape(j), None if j == i else j, window=window(j))
            for i, j in enumerate(self.kv_sources)
        ]

    def embed(self, tokens: mx.array) -> mx.array:
        return scaled(self.model.embed_tokens(tokens), math.sqrt(self.args.hidden_size))

    def per_layer_inputs(self, tokens: mx.array, h: mx.array) -> mx.array:
        """``[T, layers, P]``: each token's per-layer embedding plus the normalised projection of its
        embedding ``h``, averaged (times 1/sqrt(2))."""
        args, inner = self.args, self.model
        shape = (tokens.shape[0], args.num_hidden_layers, args.hidden_size_per_layer_input)
        rows = inner.embed_tokens_per_layer(tokens).astype(h.dtype)  # the table may be narrower (row_tables)
        table = scaled(rows, math.sqrt(args.hidden_size_per_layer_input))
        projected = inner.per_layer_model_projection(h) * args.hidden_size**-0.5
        projected = inner.per_layer_projection_norm(projected.reshape(shape))
        return (projected + table.reshape(shape)) * 2.0**-0.5

    def hidden(
        self, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> tuple[mx.array, BatchMetadata]:
        h = self.embed(tokens)
        per_layer = self.per_layer_inputs(tokens, h) if self.args.hidden_size_per_layer_input else None
        first_shared = self.args.num_hidden_layers - self.args.num_kv_shared_layers
        for i, layer in enumerate(self.layers):
            if i == first_shared and (last := last_rows_only(meta)) is not None:
                # From here on layers write no K/V, so only the rows whose logits the step wants
                # matter (as transformers does): a prompt chunk goes on as one decode row.
                rows = meta.logits_index
                h, meta = h[rows], last
                per_layer = None if per_layer is None else per_layer[rows]
            h = layer(h, cache[self.kv_sources[i]], meta, None if per_layer is None else per_layer[:, i])
        return h, meta

    def head(self, h: mx.array) -> mx.array:
        return softcap(super().head(h), self.args.final_logit_softcapping)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        out = text_tower(weights, _DROPPED_PREFIXES)
        if self.args.tie_word_embeddings:
            out.pop("lm_head.weight", None)
        unused = tuple(
            f"model.layers.{i}.self_attn.{name}."
            for i in range(self.args.num_hidden_layers)
            if self.args.kv_source(i) is not None
            for name in _UNUSED_IN_SHARED
        )
        out = {k: v for k, v in out.items() if not k.startswith(unused)}  # quantized ones' scales too
        for i in range(self.args.num_hidden_layers):
            prefix = f"model.layers.{i}."
            gate_up = out.pop(f"{prefix}experts.gate_up_proj", None)
            if gate_up is not None:  # Hugging Face: [E, 2I, D] gate then up, and down [E, D, I]
                glu = f"{prefix}experts.switch_glu."
                out[f"{glu}gate_proj.weight"], out[f"{glu}up_proj.weight"] = mx.split(gate_up, 2, axis=1)
                out[f"{glu}down_proj.weight"] = out.pop(f"{prefix}experts.down_proj")
        return out
