"""Tensor parallel: every rank runs every layer on its share of the attention heads and MLP columns.

Column-parallel projections (q/k/v or Phi-3's fused ``qkv_proj``, gate/up or ``gate_up_proj``, MoE experts'
gate/up along the intermediate dim) keep this rank's output rows, gpt-oss's attention sinks the sinks of its
heads; row-parallel ones (``o_proj``, ``down_proj``, experts' down) keep the matching input columns, so
each rank's attention and MLP produce a partial sum of the full output, and one ``all_sum`` per attention
and per MLP (Gemma 4's routed experts: one more) completes it. Embedding, norms, MoE routers, Gemma 4's
per-layer input projections (small) and the head stay whole on every rank. Works on the module layout
shared by every architecture of the zoo (blocks with ``self_attn`` and ``mlp``; attention with
``n_heads``, ``n_kv_heads``, ``head_dim``), plain or quantized.

Multi-head latent attention (DeepSeek, Kimi K2, GLM-4.7-Flash) splits by heads as vLLM and mlx-lm do:
``q_b_proj`` (or ``q_proj``) rows and the per-head halves of ``kv_b_proj`` (``embed_q``, ``unembed_out``)
by head, ``o_proj`` by input. Every head reads the whole latent row of a token, so the latent projection
runs on every rank and each rank's pool holds every row (the same pool as one process). Gemma 4's
KV-shared layers read their source layer's pool on their own rank, which holds the KV heads of this
rank's query heads. A hybrid's Gated DeltaNet layers (Qwen3-Next, Qwen3.5) split by key heads and the
value heads they serve (input projections, convolution channels, decay parameters; ``out_proj`` by
input), so each rank's state slots hold its heads' state.
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
        h, meta = model.hidden(tokens, cache, meta)
        # Every rank must run every all_sum of the step, even when the runner wants no logits and would
        # evaluate only the KV writes (which do not depend on the last MLP's all_sum).
        mx.async_eval(h)
        return model.logits(h, meta)

    def follower(
        self, model: nn.Module, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> list[mx.array]:
        """Only rank 0 samples, so the others stop before the head."""
        return [model.hidden(tokens, cache, meta)[0], *[a for kv in cache for a in kv.state()]]


def shard_tensor(model: nn.Module, group: mx.distributed.Group) -> TensorShard:
    """Split every block of ``model`` (in place) into this rank's share; refuse shapes that do not divide."""
    size, rank = group.size(), group.rank()
    shard = TensorShard(group, model.embed(mx.array([0])).dtype)
    layout = model.kv_layout()
    for i, layer in enumerate(model.layers):
        if "linear_attn" in layer:  # a hybrid's Gated DeltaNet layer: its state holds its heads' rows
            _shard_delta_net(layer.linear_attn, rank, size)
            layout[i] = layer.linear_attn.state_spec()
            layer.linear_attn = AllSum(layer.linear_attn, group, shard.traffic)
        else:
            attn = layer.self_attn
            if hasattr(attn, "kv_lora_rank"):  # a latent pool holds every row on every rank
                _shard_latent_attention(attn, rank, size)
            else:
                _shard_attention(attn, rank, size)
                layout[i] = replace(layout[i], n_kv_heads=rank_kv_heads(layout[i].n_kv_heads, size))
            layer.self_attn = AllSum(attn, group, shard.traffic)
        _shard_mlp(layer.mlp, rank, size)
        layer.mlp = AllSum(layer.mlp, group, shard.traffic)
        if "experts" in layer:  # Gemma 4: routed experts beside the dense MLP, each with its own norm
            _shard_mlp(layer.experts, rank, size)
            layer.experts = AllSum(layer.experts, group, shard.traffic)
    # What this rank's pools and state slots hold (an instance attribute shadows the method).
    model.kv_layout = lambda: layout
    return shard


def _shard_attention(attn: nn.Module, rank: int, size: int) -> None:
    heads, kv_heads, d = attn.n_heads, attn.n_kv_heads, attn.head_dim
    if heads % size or (kv_heads % size and size % kv_heads):
        raise DistributedError(
            f"tensor parallel over {size} ranks needs the attention heads ({heads}) and KV heads "
            f"({kv_heads}) to divide by {size} (or the KV heads to divide {size}); use --strategy pipeline"
        )
    # Qwen3-Next's gated attention: each head's query rows then its gate's, so 2d rows a head.
    q_rows = attn.q_proj.weight.shape[-2] // heads if "q_proj" in attn else d
    q = _part(heads * d, rank, size)
    kv = _kv_part(kv_heads, rank, size)
    kv = (kv[0] * d, kv[1] * d)
    if "qkv_proj" in attn:  # Phi-3: rows are [q | k | v]
        k_at, v_at = heads * d, (heads + kv_heads) * d
        _keep_rows(attn.qkv_proj, [q, _shift(kv, k_at), _shift(kv, v_at)])
    else:
        # Gemma 4: a KV-shared layer has no k/v projections, a global one with keys as values no v_proj.
        for name, rows in (("q_proj", _part(heads * q_rows, rank, size)), ("k_proj", kv), ("v_proj", kv)):
            if name in attn:
                _keep_rows(attn[name], [rows])
    _keep_columns(attn.o_proj, q, rank)
    if "sinks" in attn:  # gpt-oss: one sink logit per query head, so this rank's heads' sinks
        attn.sinks = _take(attn.sinks, -1, *_part(heads, rank, size))
    attn.n_heads, attn.n_kv_heads = heads // size, rank_kv_heads(kv_heads, size)


def rank_kv_heads(kv_heads: int, size: int) -> int:
    """KV heads a rank keeps: its share, or, with fewer KV heads than ranks, the one its queries read."""
    return kv_heads // size if kv_heads % size == 0 else 1


def _kv_part(kv_heads: int, rank: int, size: int) -> tuple[int, int]:
    """This rank's KV heads. Fewer KV heads than ranks (Gemma 4's global layers): each head is kept by
    the ``size / kv_heads`` ranks whose query heads read it, as vLLM replicates them."""
    if kv_heads % size == 0:
        return _part(kv_heads, rank, size)
    head = rank * kv_heads // size
    return head, head + 1


def _shard_latent_attention(attn: nn.Module, rank: int, size: int) -> None:
    """MLA: this rank's heads of the query, of both halves of ``kv_b_proj`` and of ``o_proj``'s input."""
    heads = attn.n_heads
    if heads % size:
        raise DistributedError(
            f"tensor parallel over {size} ranks needs the attention heads ({heads}) to divide by {size}; "
            "use --strategy pipeline"
        )
    q_dim = attn.nope_dim + attn.rope_dim
    v_dim = attn.unembed_out.weight.shape[-2]
    _keep_rows(attn.q_proj if "q_proj" in attn else attn.q_b_proj, [_part(heads * q_dim, rank, size)])
    for per_head in (attn.embed_q, attn.unembed_out):  # [heads, out, in], plain or quantized
        for name in ("weight", "scales", "biases"):
            if name in per_head:
                per_head[name] = _take(per_head[name], 0, *_part(heads, rank, size))
    _keep_columns(attn.o_proj, _part(heads * v_dim, rank, size), rank)
    attn.n_heads = heads // size


def _shard_delta_net(net: nn.Module, rank: int, size: int) -> None:
    """Gated DeltaNet: this rank's key heads and the value heads they serve, in every input projection,
    the convolution's q, k and v channels, the per-head decay parameters and ``out_proj``'s input."""
    hk, hv, dk, dv = net.num_k_heads, net.num_v_heads, net.head_k_dim, net.head_v_dim
    if hk % size:
        raise DistributedError(
            f"tensor parallel over {size} ranks needs the linear-attention key heads ({hk}) to divide by "
            f"{size}; use --strategy pipeline"
        )
    k, v = _part(hk * dk, rank, size), _part(hv * dv, rank, size)
    channels = [k, _shift(k, hk * dk), _shift(v, 2 * hk * dk)]  # the convolution runs over [q | k | v]
    heads = _part(hv, rank, size)
    if "in_proj_qkvz" in net:  # Qwen3-Next: rows grouped by key head (q, k, then its value heads' v, z)
        _keep_rows(net.in_proj_qkvz, [_part(hk * (2 * dk + 2 * hv // hk * dv), rank, size)])
        _keep_rows(net.in_proj_ba, [_part(2 * hv, rank, size)])
    else:  # Qwen3.5: [q | k | v], z, b and a apart
        _keep_rows(net.in_proj_qkv, channels)
        _keep_rows(net.in_proj_z, [v])
        _keep_rows(net.in_proj_b, [heads])
        _keep_rows(net.in_proj_a, [heads])
    net.conv1d.weight = mx.concatenate([_take(net.conv1d.weight, 0, a, b) for a, b in channels])
    net.dt_bias = _take(net.dt_bias, 0, *heads)
    net.A_log = _take(net.A_log, 0, *heads)
    _keep_columns(net.out_proj, v, rank)
    net.num_k_heads, net.num_v_heads = hk // size, hv // size
    net.key_dim, net.value_dim = net.key_dim // size, net.value_dim // size
    net.conv_dim = 2 * net.key_dim + net.value_dim


def _shard_mlp(mlp: nn.Module, rank: int, size: int) -> None:
    # Qwen3-MoE's name, gpt-oss's, Gemma 4's
    experts = mlp.get("switch_mlp", mlp.get("experts", mlp.get("switch_glu")))
    if experts is not None:  # MoE: stacked experts [E, out, in], split along the intermediate dim
        cols = _part(experts.gate_proj.weight.shape[-2], rank, size, "expert intermediate size")
        _keep_rows(experts.gate_proj, [cols])
        _keep_rows(experts.up_proj, [cols])
        _keep_columns(experts.down_proj, cols, rank)
        # GLM-4.5's, DeepSeek's dense SwiGLU beside the routed experts, summed too; Qwen3-Next's is
        # scaled by a gate of the whole input (a scalar a token), so its partial sums add up as well.
        for name in ("shared_experts", "shared_expert"):
            if name in mlp:
                _shard_mlp(mlp[name], rank, size)
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
