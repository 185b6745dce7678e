"""GLM-4.5 / GLM-4.6 (``glm4_moe``): Qwen-style attention with partial RoPE, then dense MLPs for the
first ``first_k_dense_replace`` layers and a mixture of experts with a shared expert after them.

The router (DeepSeek-V3's "noaux_tc"): sigmoid scores; ``e_score_correction_bias`` is added for the
choice only, experts are chosen among the ``topk_group`` best of ``n_group`` groups (a group's score is
the sum of its two best), and the chosen experts are weighted by their uncorrected scores, normalised
when ``norm_topk_prob``, times ``routed_scaling_factor``. Experts are stacked as in ``qwen3_moe``.
Checkpoints on the Hub carry a multi-token-prediction layer after the last one, which is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.models import qwen2
from mlx_infer.models.base import CausalLM, apply_rope, rope_frequencies
from mlx_infer.models.deepseek_v3 import MoE
from mlx_infer.models.llama import MLP
from mlx_infer.models.qwen3_moe import stack_experts


@dataclass
class ModelArgs(qwen2.ModelArgs):
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 131072
    attention_bias: bool = False
    use_qk_norm: bool = False
    partial_rotary_factor: float | None = None
    first_k_dense_replace: int = 1
    n_routed_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 1
    n_group: int = 1
    topk_group: int = 1
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True
    # GLM routes as DeepSeek V3 does (sigmoid scores, the correction bias for selection only, groups
    # ranked by their two best scores), so its MoE is DeepSeek V3's.
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"

    def __post_init__(self):
        super().__post_init__()
        # transformers >= 5 moves the factor into rope_parameters; older configs keep it at the top.
        # Without either, transformers' Glm4MoeConfig defaults it to 0.5.
        factor = (self.rope_parameters or {}).get("partial_rotary_factor", self.partial_rotary_factor)
        self.partial_rotary_factor = 0.5 if factor is None else float(factor)

    @property
    def rope_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class Attention(qwen2.Attention):
    """Qwen's attention (q/k/v biases, optional per-head q/k norms) rotating only ``rope_dims``."""

    def __init__(self, args: ModelArgs, layer_idx: int):
        super().__init__(
            args, layer_idx, qkv_bias=args.attention_bias, o_bias=False, qk_norm=args.use_qk_norm
        )
        self.rope_dims = args.rope_dims
        self._freqs = rope_frequencies(
            self.head_dim, args.rope_theta, args.rope_scaling, self.rope_dims, args.max_position_embeddings
        )

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(
            x, positions, self.rope_dims, self.rope_base, False, self.rope_scale, self._freqs,
            self.rope_factor,
        )


class Model(CausalLM):
    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = qwen2.QwenModel(args, [self.make_block(args, i) for i in range(args.num_hidden_layers)])

    @staticmethod
    def make_block(args: ModelArgs, layer_idx: int) -> qwen2.TransformerBlock:
        if layer_idx >= args.first_k_dense_replace:
            mlp: nn.Module = MoE(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size)
        return qwen2.TransformerBlock(args, Attention(args, layer_idx), mlp)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        layers = self.args.num_hidden_layers
        # The multi-token-prediction layers are numbered from num_hidden_layers on.
        weights = {
            k: v for k, v in super().sanitize(weights).items()
            if not (k.startswith("model.layers.") and int(k.split(".")[2]) >= layers)
        }
        for i in range(self.args.first_k_dense_replace, layers):
            stack_experts(weights, f"model.layers.{i}.mlp", self.args.n_routed_experts, "glm4_moe")
        return weights
