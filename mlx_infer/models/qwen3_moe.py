"""Qwen3-MoE: Qwen3 attention with a top-k routed mixture of SwiGLU experts in the sparse layers.

Experts are stored stacked, ``mlp.switch_mlp.{gate,up,down}_proj.weight`` of shape
``[num_experts, out, in]`` (mlx-lm's names, so converted checkpoints load there too), and applied with
``mx.gather_mm`` over the tokens sorted by expert. :meth:`Model.sanitize` stacks Hugging Face's
per-expert tensors ``mlp.experts.{e}.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.models import qwen2, qwen3
from mlx_infer.models.llama import MLP
from mlx_infer.models.routing import top_k_experts

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArgs(qwen3.ModelArgs):
    num_experts: int = 128
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    num_local_experts: int | None = None  # transformers >= 5 saves num_experts under this name

    def __post_init__(self):
        super().__post_init__()
        if self.num_local_experts is not None:
            self.num_experts = self.num_local_experts

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            layer_idx not in self.mlp_only_layers
            and self.num_experts > 0
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


def _add_expert_bias(module: nn.Module, out: mx.array, indices: mx.array) -> mx.array:
    """``out`` ([N, 1, out]) plus each row's expert bias, where the layer has one (gpt-oss)."""
    return out + module["bias"][indices][:, None, :] if "bias" in module else out


class SwitchLinear(nn.Module):
    """``num_experts`` linear layers (bias-free unless ``bias``); input row ``i`` goes through expert
    ``indices[i]``."""

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, bias: bool = False):
        super().__init__()
        scale = math.sqrt(1 / input_dims)
        self.weight = mx.random.uniform(-scale, scale, (num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        out = mx.gather_mm(x, self.weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=True)
        return _add_expert_bias(self, out, indices)

    def to_quantized(
        self, group_size: int | None = None, bits: int | None = None, mode: str = "affine", **_
    ) -> QuantizedSwitchLinear:
        """Called by ``nn.quantize`` so quantized MoE checkpoints load into the same module tree."""
        return QuantizedSwitchLinear(self.weight, group_size, bits, mode, self.get("bias"))


class QuantizedSwitchLinear(nn.Module):
    def __init__(
        self,
        weight: mx.array,
        group_size: int | None,
        bits: int | None,
        mode: str,
        bias: mx.array | None = None,
    ):
        super().__init__()
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        if biases:
            self.biases = biases[0]
        if bias is not None:
            self.bias = bias
        # Read back what mx.quantize chose when group_size/bits were left to the mode's defaults.
        in_dims = weight.shape[-1]
        self.group_size = in_dims // self.scales.shape[-1]
        self.bits = self.weight.shape[-1] * 32 // in_dims
        self.mode = mode
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        out = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            sorted_indices=True,
        )
        return _add_expert_bias(self, out, indices)


def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


class SwitchGLU(nn.Module):
    """Gated experts (SwiGLU unless ``activation(gate, up)`` says otherwise) applied to each
    (token, chosen expert) pair."""

    def __init__(
        self,
        dim: int,
        hidden_dim: int,
        num_experts: int,
        bias: bool = False,
        activation: Callable[[mx.array, mx.array], mx.array] = swiglu,
    ):
        super().__init__()
        self.gate_proj = SwitchLinear(dim, hidden_dim, num_experts, bias)
        self.up_proj = SwitchLinear(dim, hidden_dim, num_experts, bias)
        self.down_proj = SwitchLinear(hidden_dim, dim, num_experts, bias)
        self.activation = activation

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        """``x`` [T, D], ``indices`` [T, k] -> [T, k, D]."""
        n_tokens, top_k = indices.shape
        flat = indices.reshape(-1)
        # Sorting the (token, expert) pairs by expert lets gather_mm run each expert over one
        # contiguous run of rows instead of one matrix-vector product per pair.
        order = mx.argsort(flat)
        inverse = mx.argsort(order)
        rows = x[order // top_k][:, None, :]  # [T*k, 1, D]
        idx = flat[order]
        h = self.activation(self.gate_proj(rows, idx), self.up_proj(rows, idx))
        out = self.down_proj(h, idx)[inverse]  # [T*k, 1, D] back in (token, slot) order
        return out.reshape(n_tokens, top_k, -1)


class SparseMoeBlock(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.top_k = args.num_experts_per_tok
        self.norm_topk_prob = args.norm_topk_prob
        self.gate = nn.Linear(args.hidden_size, args.num_experts, bias=False)
        self.switch_mlp = SwitchGLU(args.hidden_size, args.moe_intermediate_size, args.num_experts)

    def __call__(self, x: mx.array) -> mx.array:
        # Router probabilities in float32, as transformers computes them, whatever the weights' dtype.
        probs = mx.softmax(self.gate(x).astype(mx.float32), axis=-1)
        k = self.top_k
        inds = top_k_experts(probs, k)
        scores = mx.take_along_axis(probs, inds, axis=-1)
        if self.norm_topk_prob:
            scores = scores / scores.sum(axis=-1, keepdims=True)
        y = self.switch_mlp(x, inds)
        return (y * scores[..., None].astype(y.dtype)).sum(axis=-2)


class Model(qwen3.Model):
    def make_block(self, args: ModelArgs, layer_idx: int) -> qwen2.TransformerBlock:
        if args.is_sparse(layer_idx):
            mlp: nn.Module = SparseMoeBlock(args)
        else:
            mlp = MLP(args.hidden_size, args.intermediate_size)
        return qwen2.TransformerBlock(args, self.make_attention(args, layer_idx), mlp)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = super().sanitize(weights)
        for i in range(self.args.num_hidden_layers):
            stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts, "qwen3_moe")
        return weights


def stack_experts(weights: dict[str, mx.array], prefix: str, num_experts: int, arch: str) -> None:
    """Turn the experts under ``prefix`` (a layer's ``...mlp``) into ``{prefix}.switch_mlp.*``, in place.

    Checkpoints hold Hugging Face's per-expert tensors ``{prefix}.experts.{e}.{gate,up,down}_proj.weight``
    (what ``save_pretrained`` writes), or transformers 5's fused in-memory layout
    ``{prefix}.experts.gate_up_proj`` ``[E, 2 * I, D]`` (gate rows first) and ``.down_proj`` ``[E, D, I]``.
    A dense layer, or experts already stacked, are left alone.
    """
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        down = weights.pop(f"{prefix}.experts.down_proj", None)
        if down is None:
            raise InvalidCheckpoint(f"{arch}: missing expert tensor {prefix}.experts.down_proj")
        gate, up = mx.split(fused, 2, axis=1)
        stacked = {"gate_proj": gate, "up_proj": up, "down_proj": down}
        for name, value in stacked.items():
            weights[f"{prefix}.switch_mlp.{name}.weight"] = value
        return
    if f"{prefix}.experts.0.gate_proj.weight" not in weights:
        return
    for name in _PROJECTIONS:
        try:
            experts = [weights.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(num_experts)]
        except KeyError as err:
            raise InvalidCheckpoint(f"{arch}: missing expert tensor {err.args[0]}") from None
        weights[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(experts)
