"""DeepSeek V3 / V3.1 / R1, Kimi K2, GLM-4.7-Flash and DeepSeek V2: multi-head latent attention and MoE.

Attention is MLA over a latent cache (``models/mla.py``): one ``[c_kv, k_pe]`` row per token and layer.
The MoE (every layer from ``first_k_dense_replace`` on) routes with sigmoid scores; a per-expert
``e_score_correction_bias`` is added for the *choice* only, the experts are split into ``n_group`` groups
of which the ``topk_group`` with the largest sum of their two best scores are eligible, and the chosen
experts' weights (plain sigmoid scores, normalised when ``norm_topk_prob``) are multiplied by
``routed_scaling_factor``; shared experts see every token. As transformers' ``DeepseekV3TopkRouter``.
DeepSeek V2 routes with softmax scores instead (:class:`Gate`), its layers otherwise the same.

Weights: Hugging Face's names, except that :meth:`Model.sanitize` stacks the routed experts
(``mlp.switch_mlp.*``, as qwen3_moe) and splits ``kv_b_proj`` into mlx-lm's per-head ``embed_q`` (key
half, transposed) and ``unembed_out`` (value half), the form the absorbed attention multiplies by; so
mlx-lm's converted DeepSeek checkpoints load as they are, and ours load there. It also takes the names
llama.cpp's converter gives a GGUF, and drops the multi-token-prediction layer. (DeepSeek's and Kimi's
own FP8 checkpoints are dequantized by the loader, ``loading/fp8.py``.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import UnsupportedArchitecture
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import KVSpec, LatentKV
from mlx_infer.models.base import (
    BaseModelArgs,
    CausalLM,
    apply_rope,
    rope_attention_factor,
    rope_frequencies,
    rope_scale,
    yarn_mscale,
)
from mlx_infer.models.composite import text_tower
from mlx_infer.models.llama import MLP
from mlx_infer.models.mla import MultiLinear, latent_attention
from mlx_infer.models.qwen3_moe import SwitchGLU, stack_experts
from mlx_infer.models.rope_config import resolve_rope, scaling_type
from mlx_infer.models.routing import top_k_experts

# (topk_method, scoring_func) of the routers here: DeepSeek V3's, and V2's greedy and group-limited ones.
ROUTINGS = (("noaux_tc", "sigmoid"), ("greedy", "softmax"), ("group_limited_greedy", "softmax"))


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    moe_intermediate_size: int = 2048
    n_shared_experts: int | None = None
    n_routed_experts: int | None = None
    routed_scaling_factor: float = 1.0
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    qk_nope_head_dim: int = 128
    topk_method: str | None = None  # default: noaux_tc (DeepSeek V3), greedy for deepseek_v2
    scoring_func: str | None = None  # default: sigmoid (DeepSeek V3), softmax for deepseek_v2
    norm_topk_prob: bool = True
    n_group: int | None = 1
    topk_group: int | None = 1
    num_experts_per_tok: int = 1
    moe_layer_freq: int = 1
    first_k_dense_replace: int | None = None  # default: transformers' (see __post_init__)
    mlp_layer_types: list[str] | None = None  # GLM-4.7-Flash: "dense" / "sparse" per layer
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None  # transformers >= 5 keeps rope_theta here
    rope_interleave: bool = True  # rope on (even, odd) pairs: MLX's "traditional" layout
    attention_bias: bool = False
    tie_word_embeddings: bool = False

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> ModelArgs:
        if "text_config" in params:  # Kimi K2.5 / K2.6 (kimi_k25): keep only the text model
            text = params["text_config"]
            params = {**text, "model_type": text.get("model_type", "deepseek_v3")}
        return super().from_dict(params)

    def __post_init__(self):
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, 10000.0
        )
        v2 = self.model_type == "deepseek_v2"
        self.topk_method = self.topk_method or ("greedy" if v2 else "noaux_tc")
        self.scoring_func = self.scoring_func or ("softmax" if v2 else "sigmoid")
        if self.n_routed_experts and (self.topk_method, self.scoring_func) not in ROUTINGS:
            raise UnsupportedArchitecture(
                f"{self.model_type}: routing {self.topk_method}/{self.scoring_func} is not supported "
                f"(supported: {', '.join('/'.join(r) for r in ROUTINGS)})"
            )
        if self.first_k_dense_replace is None and self.mlp_layer_types is None:
            # transformers' defaults for a config that leaves both out (GLM's: dense first, then sparse)
            self.first_k_dense_replace = {"deepseek_v2": 0, "glm4_moe_lite": 1}.get(self.model_type, 3)
        self.n_group = self.n_group or 1
        self.topk_group = self.topk_group or 1

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Width of a cache row: the latent ``c_kv`` then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_sparse(self, layer_idx: int) -> bool:
        if self.mlp_layer_types is not None:
            return self.mlp_layer_types[layer_idx] == "sparse"
        return (
            bool(self.n_routed_experts)
            and layer_idx >= self.first_k_dense_replace
            and layer_idx % self.moe_layer_freq == 0
        )


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.q_lora_rank = args.q_lora_rank
        self.nope_dim = args.qk_nope_head_dim
        self.rope_dim = args.qk_rope_head_dim
        self.kv_lora_rank = args.kv_lora_rank
        dim = args.hidden_size
        if args.q_lora_rank is None:
            self.q_proj = nn.Linear(dim, self.n_heads * args.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(dim, args.q_lora_rank, bias=args.attention_bias)
            self.q_a_layernorm = nn.RMSNorm(args.q_lora_rank, eps=1e-6)  # transformers' default eps
            self.q_b_proj = nn.Linear(args.q_lora_rank, self.n_heads * args.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(dim, args.latent_dim, bias=args.attention_bias)
        self.kv_a_layernorm = nn.RMSNorm(args.kv_lora_rank, eps=1e-6)
        self.embed_q = MultiLinear(self.nope_dim, self.kv_lora_rank, self.n_heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, args.v_head_dim, self.n_heads)
        self.o_proj = nn.Linear(self.n_heads * args.v_head_dim, dim, bias=args.attention_bias)

        scaling, max_pos = args.rope_scaling, args.max_position_embeddings
        self.scale = args.qk_head_dim**-0.5 * softmax_mscale(scaling) ** 2
        self.rope_base = args.rope_theta
        self.rope_traditional = args.rope_interleave
        self.rope_scale = rope_scale(scaling)
        self._freqs = rope_frequencies(self.rope_dim, args.rope_theta, scaling, None, max_pos)
        self.rope_factor = rope_attention_factor(scaling, max_pos)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.rope_dim, self.rope_base, self.rope_traditional, self.rope_scale, self._freqs,
            self.rope_factor,
        )

    def __call__(self, x: mx.array, kv: LatentKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(n, self.n_heads, -1)
        q_nope, q_pe = q[..., : self.nope_dim], q[..., self.nope_dim :]
        compressed = self.kv_a_proj_with_mqa(x)
        c_kv = self.kv_a_layernorm(compressed[:, : self.kv_lora_rank])
        k_pe = self.rope(compressed[:, None, self.kv_lora_rank :], meta.positions)
        q_pe = self.rope(q_pe, meta.positions)
        # q_nope . (W_uk c) = (q_nope W_uk) . c: the query goes into latent space once, per head.
        q_latent = self.embed_q(q_nope.swapaxes(0, 1)).swapaxes(0, 1)  # [T, H, kv_lora_rank]
        queries = mx.concatenate([q_latent, q_pe], axis=-1)
        latent = mx.concatenate([c_kv[:, None], k_pe], axis=-1)  # [T, 1, kv_lora_rank + rope_dim]
        out = latent_attention(queries, latent, kv, meta, self.scale, self.kv_lora_rank)
        out = self.unembed_out(out.swapaxes(0, 1)).swapaxes(0, 1)  # [T, H, v_head_dim]
        return self.o_proj(out.reshape(n, -1))


def softmax_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's YaRN also scales the softmax (every dimension, not only the rotated ones) by
    ``mscale(factor, mscale_all_dim)`` squared, as transformers' ``yarn_apply_mscale``."""
    if scaling_type(scaling) == "default" or not scaling.get("mscale_all_dim"):
        return 1.0
    return yarn_mscale(scaling["factor"], scaling["mscale_all_dim"])


class Gate(nn.Module):
    """The router: ``weight`` [experts, hidden], and for DeepSeek V3's sigmoid routing the
    selection-only ``e_score_correction_bias``. DeepSeek V2's routes with softmax scores, greedily or
    from the ``topk_group`` groups with the best single score (``group_limited_greedy``)."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.n_group = args.n_group
        self.topk_group = args.topk_group
        self.norm_topk_prob = args.norm_topk_prob
        self.routed_scaling_factor = args.routed_scaling_factor
        self.softmax = args.scoring_func == "softmax"
        self.group_limited = args.topk_method != "greedy" and args.n_group > 1
        self.weight = mx.zeros((args.n_routed_experts, args.hidden_size))
        if not self.softmax:
            self.e_score_correction_bias = mx.zeros((args.n_routed_experts,))

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        """(expert indices [T, k], their weights [T, k] in float32) for ``x`` [T, D]."""
        # In float32 whatever the weights' dtype, as transformers computes the router.
        logits = x.astype(mx.float32) @ self.weight.astype(mx.float32).T
        if self.softmax:
            scores = choice = mx.softmax(logits, axis=-1)
        else:
            scores = mx.sigmoid(logits)
            choice = scores + self.e_score_correction_bias.astype(mx.float32)
        if self.group_limited:
            n_tokens, n_experts = choice.shape
            grouped = choice.reshape(n_tokens, self.n_group, n_experts // self.n_group)
            # V3 ranks a group by the sum of its two best scores, V2 by its best one.
            group_scores = grouped.max(axis=-1) if self.softmax else mx.topk(grouped, 2, axis=-1).sum(axis=-1)
            best = top_k_experts(group_scores, self.topk_group)
            kept = (mx.arange(self.n_group)[None, None, :] == best[..., None]).any(axis=1)  # [T, n_group]
            # Left out as transformers leaves them: a zero probability (V2), never chosen (V3).
            left_out = 0.0 if self.softmax else -mx.inf
            choice = mx.where(kept[..., None], grouped, left_out).reshape(n_tokens, n_experts)
        inds = top_k_experts(choice, self.top_k)
        weights = mx.take_along_axis(scores, inds, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
        return inds, weights * self.routed_scaling_factor


class MoE(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.gate = Gate(args)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.n_routed_experts)
        if args.n_shared_experts:
            self.shared_experts = MLP(args.hidden_size, args.moe_intermediate_size * args.n_shared_experts)

    def __call__(self, x: mx.array) -> mx.array:
        inds, weights = self.gate(x)
        y = self.switch_mlp(x, inds)
        y = (y * weights[..., None].astype(y.dtype)).sum(axis=-2)
        if "shared_experts" in self:
            y = y + self.shared_experts(x)
        return y


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MoE(args) if args.is_sparse(layer_idx) else MLP(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, x: mx.array, kv: LatentKV, meta: BatchMetadata) -> mx.array:
        h = x + self.self_attn(self.input_layernorm(x), kv, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = [DecoderLayer(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = DeepseekV3Model(args)

    def kv_shape(self) -> tuple[int, int]:
        """One latent row per token: a single "KV head" of ``kv_lora_rank + qk_rope_head_dim``."""
        return 1, self.args.latent_dim

    def kv_layout(self) -> list[KVSpec]:
        """Every layer a latent pool: the row's first ``kv_lora_rank`` values are the attention's values."""
        return [KVSpec(1, self.args.latent_dim, values_in_keys=True)] * len(self.layers)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(text_tower(weights, _OTHER_TOWERS, _TEXT_PREFIXES))
        n_layers = self.args.num_hidden_layers
        # Multi-token-prediction modules are saved as layers past the last one; nothing here runs them.
        weights = {k: v for k, v in weights.items() if _layer_index(k) is None or _layer_index(k) < n_layers}
        weights = {_llama_cpp_name(k): v for k, v in weights.items()}
        for i in range(n_layers):
            prefix = f"model.layers.{i}"
            stack_experts(weights, f"{prefix}.mlp", self.args.n_routed_experts, self.args.model_type)
            self._split_kv_b(weights, f"{prefix}.self_attn")
        return weights

    def _split_kv_b(self, weights: dict[str, mx.array], prefix: str) -> None:
        """``kv_b_proj`` [heads * (nope + v), kv_lora_rank] -> ``embed_q`` [heads, kv_lora_rank, nope] (its
        key half, transposed: it maps a query's nope part into latent space) and ``unembed_out``
        [heads, v, kv_lora_rank] (its value half). A quantized one is dequantized first (exactly)."""
        w = weights.pop(f"{prefix}.kv_b_proj.weight", None)
        if w is None:
            return
        if f"{prefix}.kv_b_proj.scales" in weights:
            scales = weights.pop(f"{prefix}.kv_b_proj.scales")
            biases = weights.pop(f"{prefix}.kv_b_proj.biases", None)
            rank = self.args.kv_lora_rank
            w = mx.dequantize(
                w, scales, biases, group_size=rank // scales.shape[-1], bits=w.shape[-1] * 32 // rank
            )
        args = self.args
        w = w.reshape(args.num_attention_heads, args.qk_nope_head_dim + args.v_head_dim, -1)
        weights[f"{prefix}.embed_q.weight"] = mx.contiguous(w[:, : args.qk_nope_head_dim].swapaxes(-1, -2))
        weights[f"{prefix}.unembed_out.weight"] = mx.contiguous(w[:, args.qk_nope_head_dim :])


# What llama.cpp's converter (and so a GGUF, read with transformers' names) calls our parameters: its
# k_b_proj / v_b_proj are kv_b_proj split per head exactly as embed_q / unembed_out are.
_LLAMA_CPP_NAMES = {
    "self_attn.k_b_proj.": "self_attn.embed_q.",
    "self_attn.v_b_proj.": "self_attn.unembed_out.",
    "mlp.gate.e_score_correction.bias": "mlp.gate.e_score_correction_bias",
}


def _llama_cpp_name(name: str) -> str:
    for theirs, ours in _LLAMA_CPP_NAMES.items():
        if theirs in name:
            return name.replace(theirs, ours)
    return name


# The text model inside a composite (Kimi K2.5): its prefixes in the original checkpoints, as
# transformers saves it (blocks for layers) and as transformers 5 holds it; the other towers are dropped.
_TEXT_PREFIXES = {
    "language_model.model.blocks.": "model.layers.",
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
_OTHER_TOWERS = ("vision_tower.", "mm_projector.", "multi_modal_projector.", "model.vision_tower.",
                 "model.mm_projector.", "model.multi_modal_projector.")  # fmt: skip


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2])
    return None
