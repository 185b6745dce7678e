"""Tensor parallel: every rank runs every layer on its share of the attention heads and MLP columns.

Column-parallel projections (q/k/v or Phi-3's fused ``qkv_proj``, gate/up or ``gate_up_proj``, MoE experts'
gate/up along the intermediate dim) keep this rank's output rows, gpt-oss's attention sinks the sinks of its
heads; row-parallel ones (``o_proj``, ``down_proj``, experts' down) keep the matching input columns, so
each rank's attention and MLP produce a partial sum of the full output, and one ``all_sum`` per attention
and per MLP completes it. Embedding, norms, the MoE router and the head stay whole on every rank. Works on
the module layout shared by every architecture of the zoo (blocks with ``self_attn`` and ``mlp``; attention
with ``n_heads``, ``n_kv_heads``, ``head_dim``), plain or quantized.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import LayerKV

from .traffic import Traffic


class AllSum(nn.Module):
    """A block shard (attention or MLP) whose partial output is summed over the group."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group, traffic: Traffic):
        super().__init__()
        self.inner = inner
        self._group = group
        self._traffic = traffic

    def __call__(self, *args) -> mx.array:
        y = self.inner(*args)
        self._traffic.add(y.nbytes)
        return mx.distributed.all_sum(y, group=self._group)


@dataclass
class TensorShard:
    group: mx.distributed.Group
    dtype: mx.Dtype
    traffic: Traffic = field(default_factory=Traffic)

    def leader(
        self, model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> mx.array:
        h = _run_layers(model, tokens, cache, meta)
        # Every rank must run every all_sum of the step, even when the runner wants no logits and would
        # evaluate only the KV writes (which do not depend on the last MLP's all_sum).
        mx.async_eval(h)
        return model.logits(h, meta)

    def follower(
        self, model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> list[mx.array]:
        """Only rank 0 samples, so the others stop before the head."""
        return [_run_layers(model, tokens, cache, meta), *[a for kv in cache for a in kv.state()]]


def shard_tensor(model: nn.Module, group: mx.distributed.Group) -> TensorShard:
    """Split every block of ``model`` (in place) into this rank's share; refuse shapes that do not divide."""
    size, rank = group.size(), group.rank()
    if any(hasattr(layer.self_attn, "kv_lora_rank") for layer in model.layers):
        # Every head reads the one latent row of a token, so the pools cannot be split by KV heads.
        raise DistributedError(
            "tensor parallel does not split multi-head latent attention (MLA: DeepSeek, Kimi K2, "
            "GLM-4.7-Flash); use --strategy pipeline"
        )
    # Windows may differ: a window changes which blocks a layer keeps, not the shape of its K/V.
    shapes = {replace(spec, window=None) for spec in model.kv_layout()}
    if getattr(model, "needs_per_layer_inputs", False) or len(shapes) > 1:
        name = getattr(model.args, "model_type", type(model).__module__)
        raise DistributedError(
            f"{name}: tensor parallelism splits layers that all keep the same K/V and "
            "take only the hidden state; this model's layers differ (K/V sizes, K/V shared across "
            "layers, or per-layer inputs); use the pipeline strategy or one process"
        )
    shard = TensorShard(group, model.embed(mx.array([0])).dtype)
    n_kv_heads = head_dim = None
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        n_kv_heads, head_dim = attn.n_kv_heads // size, attn.head_dim
        _shard_attention(attn, rank, size)
        _shard_mlp(mlp, rank, size)
        layer.self_attn = AllSum(attn, group, shard.traffic)
        layer.mlp = AllSum(mlp, group, shard.traffic)
    # The KV pools hold this rank's KV heads only (an instance attribute shadows the method).
    model.kv_shape = lambda: (n_kv_heads, head_dim)
    return shard


def _shard_attention(attn: nn.Module, rank: int, size: int) -> None:
    heads, kv_heads, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    if heads % size or kv_heads % size:
        raise DistributedError(
            f"tensor parallel over {size} ranks needs the attention heads ({heads}) and KV heads "
            f"({kv_heads}) to divide by {size}; use --strategy pipeline"
        )
    q = _part(heads * d, rank, size)
    kv = _part(kv_heads * d, rank, size)
    if "qkv_proj" in attn:  # Phi-3: rows are [q | k | v]
        k_at, v_at = heads * d, (heads + kv_heads) * d
        _keep_rows(attn.qkv_proj, [q, _shift(kv, k_at), _shift(kv, v_at)])
    else:
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            _keep_rows(attn[name], [rows])
    _keep_columns(attn.o_proj, q, rank)
    if "sinks" in attn:  # gpt-oss: one sink logit per query head, so this rank's heads' sinks
        attn.sinks = _take(attn.sinks, -1, *_part(heads, rank, size))
    attn.n_heads, attn.n_kv_heads = heads // size, kv_heads // size


def _shard_mlp(mlp: nn.Module, rank: int, size: int) -> None:
    experts = mlp.get("switch_mlp", mlp.get("experts"))  # Qwen3-MoE's name, gpt-oss's
    if experts is not None:  # MoE: stacked experts [E, out, in], split along the intermediate dim
        cols = _part(experts.gate_proj.weight.shape[-2], rank, size, "expert intermediate size")
        _keep_rows(experts.gate_proj, [cols])
        _keep_rows(experts.up_proj, [cols])
        _keep_columns(experts.down_proj, cols, rank)
        if "shared_experts" in mlp:  # GLM-4.5: a dense SwiGLU beside the routed experts, summed too
            _shard_mlp(mlp.shared_experts, rank, size)
    elif "gate_up_proj" in mlp:  # Phi-3: rows are [gate | up]
        inter = mlp.gate_up_proj.weight.shape[-2] // 2
        cols = _part(inter, rank, size, "intermediate size")
        _keep_rows(mlp.gate_up_proj, [cols, _shift(cols, inter)])
        _keep_columns(mlp.down_proj, cols, rank)
    else:
        cols = _part(mlp.gate_proj.weight.shape[-2], rank, size, "intermediate size")
        _keep_rows(mlp.gate_proj, [cols])
        _keep_rows(mlp.up_proj, [cols])
        _keep_columns(mlp.down_proj, cols, rank)


def _part(n: int, rank: int, size: int, what: str = "") -> tuple[int, int]:
    if n % size:
        raise DistributedError(
            f"tensor parallel over {size} ranks needs the {what} ({n}) to divide by {size}"
        )
    step = n // size
    return rank * step, (rank + 1) * step


def _shift(span: tuple[int, int], by: int) -> tuple[int, int]:
    return span[0] + by, span[1] + by


def _keep_rows(linear: nn.Module, spans: list[tuple[int, int]]) -> None:
    """Keep the output features in ``spans`` of a (possibly quantized, possibly stacked) linear layer."""
    for name in ("weight", "scales", "biases", "bias"):
        if name in linear:
            axis = -1 if name == "bias" else -2  # weights are [..., out, in], a bias is [out]
            linear[name] = mx.concatenate([_take(linear[name], axis, a, b) for a, b in spans], axis=axis)


def _keep_columns(linear: nn.Module, span: tuple[int, int], rank: int) -> None:
    """Keep the input features in ``span``; the bias is added once, by rank 0, to the summed output."""
    a, b = span
    if "scales" in linear:  # quantized: columns are packed (weight) and grouped (scales, biases)
        group = linear.group_size
        if a % group or b % group:
            raise DistributedError(
                f"tensor parallel: a shard boundary at column {a if a % group else b} splits a quantization "
                f"group of {group}"
            )
        # Group sizes are multiples of 32, so a group boundary is a 32-bit word boundary at any bit width.
        linear["weight"] = _take(linear["weight"], -1, a * linear.bits // 32, b * linear.bits // 32)
        for name in ("scales", "biases"):
            if name in linear:
                linear[name] = _take(linear[name], -1, a // group, b // group)
    else:
        linear["weight"] = _take(linear["weight"], -1, a, b)
    if "bias" in linear and rank != 0:
        linear["bias"] = mx.zeros_like(linear["bias"])


def _take(x: mx.array, axis: int, a: int, b: int) -> mx.array:
    index = [slice(None)] * x.ndim
    index[axis] = slice(a, b)
    return x[tuple(index)]


def _run_layers(model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata) -> mx.array:
    h = model.embed(tokens)
    for layer, kv in zip(model.layers, cache):
        h = layer(h, kv, meta)
    return h
