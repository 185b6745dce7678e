"""Qwen3-Next: Gated DeltaNet linear-attention layers between gated full-attention layers, MoE MLPs with
a shared expert.

``layer_types`` says which layers are ``linear_attention`` (a :class:`GatedDeltaNet` keeping a
per-sequence recurrent state, see ``gated_delta.py`` and ``state.py``) and which ``full_attention``
(paged K/V, with an output gate computed by ``q_proj`` beside the queries and partial RoPE). Norms scale
by ``1 + weight`` (zero-centred), except the DeltaNet's gated output norm.

Also the base of ``qwen3_5`` (other input projections, dense or all-sparse MLPs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer import cpu_kernels
from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import KVSpec, LayerKV
from mlx_infer.interface.state import LayerState, StateSpec, continuing
from mlx_infer.models import qwen3_moe
from mlx_infer.models.base import BaseModelArgs, CausalLM, apply_rope, attention, rope_frequencies, rope_scale
from mlx_infer.models.gated_delta import (
    Ragged,
    causal_conv1d,
    decay_and_beta,
    decode_prelude,
    decode_step,
    prepare_qk,
    sequences_step,
)
from mlx_infer.models.llama import MLP
from mlx_infer.models.rope_config import resolve_rope

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


@dataclass
class ModelArgs(BaseModelArgs):
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    intermediate_size: int = 0
    num_key_value_heads: int = 2
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 32768
    rope_theta: float | None = None
    rope_scaling: dict[str, Any] | None = None
    rope_parameters: dict[str, Any] | None = None
    # Older configs keep it here, transformers 5 in rope_parameters.
    partial_rotary_factor: float | None = None
    attention_bias: bool = False
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    # Mixture of experts (num_experts 0: dense MLPs everywhere)
    num_experts: int = 0
    num_experts_per_tok: int = 10
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def __post_init__(self):
        if self.hidden_act != "silu":
            raise InvalidCheckpoint(f"{self.model_type}: hidden_act {self.hidden_act!r} is not supported")
        params = self.rope_parameters or {}
        factor = params.get("partial_rotary_factor", self.partial_rotary_factor)
        self.partial_rotary_factor = 0.25 if factor is None else float(factor)  # transformers' default
        self.rope_theta, self.rope_scaling = resolve_rope(
            self.model_type, self.rope_theta, self.rope_scaling, self.rope_parameters, 10000.0
        )
        if self.layer_types is None:
            n = self.full_attention_interval
            self.layer_types = [
                "full_attention" if (i + 1) % n == 0 else "linear_attention"
                for i in range(self.num_hidden_layers)
            ]

    def is_linear(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == "linear_attention"

    def is_sparse(self, layer_idx: int) -> bool:
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: the weight is stored as an offset from one (computed in float32)."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.zeros((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        native = cpu_kernels.rms_norm(x, self.weight, self.eps, offset=True)  # one op on the CPU backend
        if native is not None:
            return native
        out = mx.fast.rms_norm(x.astype(mx.float32), 1.0 + self.weight.astype(mx.float32), self.eps)
        return out.astype(x.dtype)


class GatedRMSNorm(nn.Module):
    """The DeltaNet output norm: RMSNorm (plain weight) times ``silu(gate)``."""

    def __init__(self, dims: int, eps: float):
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array, gate: mx.array) -> mx.array:
        normed = cpu_kernels.rms_norm(x, self.weight, self.eps)  # one op on the CPU backend
        if normed is None:
            normed = mx.fast.rms_norm(x.astype(mx.float32), None, self.eps).astype(x.dtype) * self.weight
        return _silu_gate(normed, gate).astype(x.dtype)


@partial(mx.compile, shapeless=True)
def _silu_gate(x: mx.array, gate: mx.array) -> mx.array:
    return x * nn.silu(gate.astype(mx.float32))


class Attention(nn.Module):
    """Full attention with an output gate: ``q_proj`` gives each head's query and gate side by side."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = self.head_dim**-0.5
        dim, bias = args.hidden_size, args.attention_bias
        self.q_proj = nn.Linear(dim, 2 * self.n_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.n_heads * self.head_dim, dim, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps)
        self.rope_dims = int(self.head_dim * args.partial_rotary_factor)
        self.rope_base = args.rope_theta
        self.rope_scale = rope_scale(args.rope_scaling)
        self._freqs = rope_frequencies(self.head_dim, args.rope_theta, args.rope_scaling, self.rope_dims)

    def rope(self, x: mx.array, positions: mx.array) -> mx.array:
        return apply_rope(x, positions, self.rope_dims, self.rope_base, False, self.rope_scale, self._freqs)

    def __call__(self, x: mx.array, kv: LayerKV, meta: BatchMetadata) -> mx.array:
        n = x.shape[0]
        q, gate = mx.split(self.q_proj(x).reshape(n, self.n_heads, 2 * self.head_dim), 2, axis=-1)
        q = self.q_norm(q)
        k = self.k_norm(self.k_proj(x).reshape(n, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(n, self.n_kv_heads, self.head_dim)
        q = self.rope(q, meta.positions)
        k = self.rope(k, meta.positions)
        out = attention(q, k, v, kv, meta, self.scale)
        return self.o_proj((out * mx.sigmoid(gate)).reshape(n, -1))


class Conv1d(nn.Module):
    """Holds the depthwise convolution's weight under Hugging Face's name and shape, ``[C, 1, K]``."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = mx.zeros((channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    """Linear attention by the gated delta rule over a causal depthwise convolution of q, k, v.

    Subclasses differ only in :meth:`project` (how the input projections are laid out).
    """

    # Input projections over the same input: one product on the CPU backend (models/fused.py).
    fused_projections = (("in_proj_qkvz", "in_proj_ba"),)

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.num_k_heads = args.linear_num_key_heads
        self.num_v_heads = args.linear_num_value_heads
        self.head_k_dim = args.linear_key_head_dim
        self.head_v_dim = args.linear_value_head_dim
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = args.linear_conv_kernel_dim
        self.conv1d = Conv1d(self.conv_dim, self.conv_kernel)
        self.dt_bias = mx.ones((self.num_v_heads,))
        self.A_log = mx.zeros((self.num_v_heads,))
        self.norm = GatedRMSNorm(self.head_v_dim, args.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, args.hidden_size, bias=False)
        self.make_projections(args)

    def make_projections(self, args: ModelArgs) -> None:
        d = args.hidden_size
        self.in_proj_qkvz = nn.Linear(d, 2 * self.key_dim + 2 * self.value_dim, bias=False)
        self.in_proj_ba = nn.Linear(d, 2 * self.num_v_heads, bias=False)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """``x`` [T, D] -> (q|k|v [T, conv_dim], z [T, Hv, Dv], b [T, Hv], a [T, Hv]).

        Qwen3-Next interleaves the projections per key head group: each of the ``Hk`` groups holds its
        q, k, then the v and z of the value heads it serves (and b, a likewise).
        """
        n = x.shape[0]
        per = self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).reshape(n, self.num_k_heads, -1)
        dk, dv = self.head_k_dim, per * self.head_v_dim
        q, k, v, z = mx.split(qkvz, [dk, 2 * dk, 2 * dk + dv], axis=-1)
        b, a = mx.split(self.in_proj_ba(x).reshape(n, self.num_k_heads, 2 * per), 2, axis=-1)
        qkv = mx.concatenate([q.reshape(n, -1), k.reshape(n, -1), v.reshape(n, -1)], axis=-1)
        return qkv, z.reshape(n, self.num_v_heads, self.head_v_dim), b.reshape(n, -1), a.reshape(n, -1)

    def state_spec(self) -> StateSpec:
        """Per sequence: the convolution's last ``K - 1`` inputs and a ``[Dk, Dv]`` matrix per value head,
        each followed by a row for the head's output (where the decode kernels write it)."""
        return StateSpec(
            ((self.conv_kernel - 1, self.conv_dim), (self.num_v_heads, self.head_k_dim + 1, self.head_v_dim))
        )

    def __call__(self, x: mx.array, state: LayerState, meta: BatchMetadata) -> mx.array:
        qkv, z, b, a = self.project(x)
        keep = continuing(meta)  # 0: the sequence starts here, from zero state
        if meta.max_query_len == 1:
            out = self.decode(qkv, b, a, state, meta, keep)
        else:
            out = self.prefill(qkv, b, a, state, meta, keep)
        return self.out_proj(self.norm(out.astype(x.dtype), z).reshape(x.shape[0], -1))

    def decode(
        self, qkv: mx.array, b: mx.array, a: mx.array, state: LayerState, meta: BatchMetadata, keep: mx.array
    ) -> mx.array:
        """One token per sequence: the output [B, Hv, Dv]; the new window and state go to the slots."""
        prelude = decode_prelude(self.num_k_heads, self.head_k_dim, self.num_v_heads, self.head_v_dim)
        weight = self.conv1d.weight[:, 0, :].T
        q, k, v, g, beta, window = prelude(
            qkv, state.read(meta, 0), weight, a, b, self.A_log, self.dt_bias, keep
        )
        state.put(0, meta.state_slots, window)
        return decode_step(q, k, v, g, beta, state, 1, meta.state_slots, keep)

    def prefill(
        self, qkv: mx.array, b: mx.array, a: mx.array, state: LayerState, meta: BatchMetadata, keep: mx.array
    ) -> mx.array:
        """Sequences of any length, padded to ``[B, Qmax]``: the output [T, Hv, Dv]; the new window and
        state go to the slots."""
        layout = Ragged.of(meta)
        window = state.read(meta, 0) * keep[:, None, None]
        mixed, window = causal_conv1d(layout.pad(qkv), window, self.conv1d.weight[:, 0, :], layout)
        mixed = nn.silu(mixed)
        bsz, q_max = mixed.shape[:2]
        q, k, v = mx.split(mixed, [self.key_dim, 2 * self.key_dim], axis=-1)
        q = q.reshape(bsz, q_max, self.num_k_heads, self.head_k_dim)
        k = k.reshape(bsz, q_max, self.num_k_heads, self.head_k_dim)
        v = v.reshape(bsz, q_max, self.num_v_heads, self.head_v_dim).astype(mx.float32)
        q, k = prepare_qk(q, k, self.num_v_heads)
        g, beta = decay_and_beta(layout.pad(a), layout.pad(b), self.A_log, self.dt_bias)
        state.put(0, meta.state_slots, window)
        out = sequences_step(q, k, v, g, beta, state, 1, meta.state_slots, keep, layout)
        return layout.unpad(out)


class SparseMoeBlock(qwen3_moe.SparseMoeBlock):
    """Routed experts plus one shared expert, weighted by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.shared_expert = MLP(args.hidden_size, args.shared_expert_intermediate_size)
        self.shared_expert_gate = nn.Linear(args.hidden_size, 1, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return super().__call__(x) + mx.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, layer_idx: int, mixer: nn.Module, mlp: nn.Module):
        super().__init__()
        self.is_linear = args.is_linear(layer_idx)
        if self.is_linear:
            self.linear_attn = mixer
        else:
            self.self_attn = mixer
        self.mlp = mlp
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def __call__(self, x: mx.array, cache: LayerKV | LayerState, meta: BatchMetadata) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = x + mixer(self.input_layernorm(x), cache, meta)
        return h + self.mlp(self.post_attention_layernorm(h))


class HybridModel(nn.Module):
    def __init__(self, args: ModelArgs, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = layers
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)


class Model(CausalLM):
    linear_attention_class: type[GatedDeltaNet] = GatedDeltaNet

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.model = HybridModel(args, [self.make_layer(args, i) for i in range(args.num_hidden_layers)])

    def make_layer(self, args: ModelArgs, layer_idx: int) -> DecoderLayer:
        mixer = self.linear_attention_class(args) if args.is_linear(layer_idx) else Attention(args)
        return DecoderLayer(args, layer_idx, mixer, self.make_mlp(args, layer_idx))

    def make_mlp(self, args: ModelArgs, layer_idx: int) -> nn.Module:
        if args.is_sparse(layer_idx):
            return SparseMoeBlock(args)
        return MLP(args.hidden_size, args.intermediate_size)

    def kv_layout(self) -> list[KVSpec | StateSpec]:
        """A linear-attention layer keeps a recurrent state per sequence, a full-attention one paged K/V."""
        kv = KVSpec(*self.kv_shape())
        return [layer.linear_attn.state_spec() if layer.is_linear else kv for layer in self.layers]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Multi-token-prediction heads (speculative drafting in other engines) are not used here.
        weights = {k: v for k, v in super().sanitize(weights).items() if not k.startswith("mtp.")}
        if from_mlx_lm(weights):
            weights = {k: from_mlx_lm_layout(k, v) for k, v in weights.items()}
        for i in range(self.args.num_hidden_layers):
            stack_experts(weights, f"model.layers.{i}.mlp", self.args.num_experts)
        return weights


# The zero-centred norms (RMSNorm above), whose weights mlx-lm stores with the one added.
OFFSET_NORMS = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
                ".q_norm.weight", ".k_norm.weight")


def from_mlx_lm(weights: dict[str, mx.array]) -> bool:
    """Whether ``weights`` are as mlx-lm's sanitize leaves them (mlx-community checkpoints, and
    ``convert``'s output for mlx-lm): the convolution as nn.Conv1d's ``[C, K, 1]`` rather than Hugging
    Face's ``[C, 1, K]``, which is also how mlx-lm tells the two apart."""
    return any(
        k.endswith("conv1d.weight") and v.shape[-1] == 1 and v.shape[1] != 1 for k, v in weights.items()
    )


def from_mlx_lm_layout(name: str, value: mx.array) -> mx.array:
    """One weight of mlx-lm's layout in Hugging Face's (which the layers here hold)."""
    if name.endswith("conv1d.weight"):
        return value.moveaxis(2, 1)
    if name.endswith(OFFSET_NORMS) and value.ndim == 1:
        return value - 1.0
    return value


def to_mlx_lm_layout(name: str, value: mx.array) -> mx.array:
    """One weight of Hugging Face's layout in mlx-lm's (the inverse of :func:`from_mlx_lm_layout`)."""
    if name.endswith("conv1d.weight"):
        return value.moveaxis(1, 2)
    if name.endswith(OFFSET_NORMS) and value.ndim == 1:
        return value + 1.0
    return value


def stack_experts(weights: dict[str, mx.array], prefix: str, num_experts: int) -> None:
    """Hugging Face's experts -> ``switch_mlp.{gate,up,down}_proj.weight`` ``[E, out, in]``, from either
    layout: one tensor per expert and projection, or fused ``experts.gate_up_proj`` ``[E, 2I, D]`` (gate
    rows first) with ``experts.down_proj`` ``[E, D, I]``."""
    fused = weights.pop(f"{prefix}.experts.gate_up_proj", None)
    if fused is not None:
        gate, up = mx.split(fused, 2, axis=1)
        weights[f"{prefix}.switch_mlp.gate_proj.weight"] = gate
        weights[f"{prefix}.switch_mlp.up_proj.weight"] = up
        weights[f"{prefix}.switch_mlp.down_proj.weight"] = weights.pop(f"{prefix}.experts.down_proj")
        return
    if f"{prefix}.experts.0.gate_proj.weight" not in weights:
        return  # a dense layer, or experts already stacked
    for name in _PROJECTIONS:
        try:
            experts = [weights.pop(f"{prefix}.experts.{e}.{name}.weight") for e in range(num_experts)]
        except KeyError as err:
            raise InvalidCheckpoint(f"missing expert tensor {err.args[0]}") from None
        weights[f"{prefix}.switch_mlp.{name}.weight"] = mx.stack(experts)
