"""GGUF files of the Gated DeltaNet hybrids (llama.cpp's ``qwen3next``, ``qwen35``, ``qwen35moe``) back to
Hugging Face's layout.

What llama.cpp's converter (``convert_hf_to_gguf.py``, Qwen3NextModel and its Qwen3.5 subclasses) changes:

- every zero-centred RMSNorm weight (all norms but the DeltaNet's gated output norm) is stored plus one;
- ``A_log`` is stored as ``ssm_a = -exp(A_log)`` (a name without ``.weight``), ``dt_bias`` as
  ``ssm_dt.bias`` (``dt_proj.bias``), the depthwise convolution squeezed to ``[C, K]``;
- Qwen3-Next's per-key-head interleaved ``in_proj_qkvz`` is split into ``attn_qkv`` (all q, all k, all v)
  and ``attn_gate`` (z), which is Qwen3.5's ``in_proj_qkv`` / ``in_proj_z`` layout; its ``in_proj_ba``
  stays interleaved (``ssm_ba``). Older files keep ``in_proj_qkvz`` whole as ``ssm_in``;
- Qwen3.5 (not Qwen3-Next) reorders the value heads from grouped by key head
  (``[k0v0, k0v1, k1v0, k1v1]``) to tiled (``[k0v0, k1v0, k0v1, k1v1]``) wherever they appear: the v rows of
  ``in_proj_qkv`` and of the convolution, ``in_proj_z``, ``in_proj_b``/``in_proj_a``, ``A_log``,
  ``dt_bias``, and the columns of ``out_proj``;
- the multi-token-prediction layer goes after the model's layers (``nextn_predict_layers``);
- optionally (``--fuse-qkv``, ``--fuse-gate-up-exps``) a full-attention layer's q, k, v rows are one
  ``attn_qkv`` and each expert's gate and up rows one ``ffn_gate_up_exps``.

Every reordering moves whole rows (or whole head blocks of columns), so quantized rows, their scales and
biases, and raw K-quant blocks move alike; values are only changed on float tensors (norms, ``A``).

llama.cpp runs every Qwen3-Next layer sparse, with the split projections: that is exactly Qwen3.5-MoE's
text model (``models/qwen3_5_moe.py``), which a ``qwen3next`` GGUF therefore loads as.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from gguf.constants import MODEL_TENSOR

from mlx_infer.errors import InvalidCheckpoint

ARCHS = ("qwen3next", "qwen35", "qwen35moe")
MODEL_TYPES = {"qwen3next": "qwen3_5_moe_text", "qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}

L = "model.layers.{bid}."
A = L + "linear_attn."
# GGUF tensor kind -> Hugging Face module path, for these architectures.
TENSOR_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.ATTN_QKV: A + "in_proj_qkv",
    MODEL_TENSOR.ATTN_GATE: A + "in_proj_z",
    MODEL_TENSOR.SSM_IN: A + "in_proj_qkvz",  # older Qwen3-Next files
    MODEL_TENSOR.SSM_BETA_ALPHA: A + "in_proj_ba",
    MODEL_TENSOR.SSM_BETA: A + "in_proj_b",
    MODEL_TENSOR.SSM_ALPHA: A + "in_proj_a",
    MODEL_TENSOR.SSM_A: A + "A_log",  # no suffix: a parameter, not a module
    MODEL_TENSOR.SSM_DT: A + "dt_proj",  # the converter's name: ssm_dt.bias is dt_bias
    MODEL_TENSOR.SSM_CONV1D: A + "conv1d",
    MODEL_TENSOR.SSM_NORM: A + "norm",
    MODEL_TENSOR.SSM_OUT: A + "out_proj",
    # --fuse-gate-up-exps: gate rows then up rows of each expert; split back in restore_hf_layout.
    MODEL_TENSOR.FFN_GATE_UP_EXP: L + "mlp.switch_mlp.gate_up_proj",
    MODEL_TENSOR.FFN_GATE_INP_SHEXP: L + "mlp.shared_expert_gate",
    MODEL_TENSOR.FFN_GATE_SHEXP: L + "mlp.shared_expert.gate_proj",
    MODEL_TENSOR.FFN_UP_SHEXP: L + "mlp.shared_expert.up_proj",
    MODEL_TENSOR.FFN_DOWN_SHEXP: L + "mlp.shared_expert.down_proj",
}
PARTS = ("weight", "scales", "biases", "bias")  # a (quantized) matrix's arrays, all with the same rows


def hf_config(config: dict[str, Any], get, head_dim: int, arch: str) -> None:
    """The DeltaNet sizes, the layer pattern and the experts from the GGUF keys."""
    config["num_hidden_layers"] -= int(get("nextn_predict_layers", 0))
    n = config["num_hidden_layers"]
    recurrent = get("attention.recurrent_layers")
    if recurrent is None:  # llama.cpp's fallback: every full_attention_interval-th layer is full attention
        interval = int(get("full_attention_interval", 4))
        recurrent = [(i + 1) % interval != 0 for i in range(n)]
    config["layer_types"] = ["linear_attention" if r else "full_attention" for r in recurrent[:n]]

    def need(key: str) -> int:
        if get(key) is None:
            raise InvalidCheckpoint(f"GGUF metadata lacks {arch}.{key}")
        return int(get(key))

    v_heads = need("ssm.time_step_rank")
    config.update(
        linear_conv_kernel_dim=need("ssm.conv_kernel"),
        linear_key_head_dim=need("ssm.state_size"),
        linear_num_key_heads=need("ssm.group_count"),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=need("ssm.inner_size") // v_heads,
        partial_rotary_factor=int(get("rope.dimension_count", head_dim // 4)) / head_dim,
    )
    if get("expert_count") is not None:
        config.update(
            num_experts=need("expert_count"),
            num_experts_per_tok=need("expert_used_count"),
            moe_intermediate_size=need("expert_feed_forward_length"),
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0)),
        )


def param_key(hf: str, suffix: str) -> str:
    """The Hugging Face parameter name of a GGUF tensor's module path and suffix."""
    if not suffix:
        return hf  # ssm_a: A_log
    if hf.endswith("linear_attn.dt_proj"):
        return hf.removesuffix("_proj") + f"_{suffix}"  # dt_bias
    return f"{hf}.{suffix}"


def column_permuted(arch: str, config: dict[str, Any]) -> set[str]:
    """GGUF names of the matrices whose columns the value-head reordering moves (Qwen3.5's ``ssm_out``).
    A raw K-quant block spans 256 columns, more than a head's, so these are read dequantized instead."""
    if arch not in ARCHS or arch == "qwen3next" or not needs_v_reorder(config):
        return set()
    linear = [i for i, kind in enumerate(config["layer_types"]) if kind == "linear_attention"]
    return {f"blk.{i}.ssm_out.weight" for i in linear}


def needs_v_reorder(config: dict[str, Any]) -> bool:
    return config["linear_num_key_heads"] != config["linear_num_value_heads"]


def restore_hf_layout(
    weights: dict[str, mx.array], config: dict[str, Any], arch: str, kquants: dict[str, str]
) -> None:
    """Undo the converter's changes in place (``weights`` already carry Hugging Face names); ``kquants``
    (module path -> raw-block kind) follows the projections that are split."""
    for key in list(weights):
        if key.endswith("norm.weight") and not key.endswith("linear_attn.norm.weight"):
            weights[key] = weights[key] - 1  # stored as 1 + w
        elif key.endswith("shared_expert_gate.weight") and weights[key].ndim == 1:
            weights[key] = weights[key][None]  # llama.cpp reads it as a vector
    for i, kind in enumerate(config["layer_types"]):
        _split_gate_up(weights, f"model.layers.{i}.mlp.switch_mlp.")
        p = f"model.layers.{i}.linear_attn."
        if kind != "linear_attention":
            if p + "in_proj_qkv.weight" in weights:  # --fuse-qkv: a full-attention layer's q, k, v rows
                _split_attention_qkv(weights, kquants, p + "in_proj_qkv", i, config)
            continue
        a = weights[p + "A_log"]
        weights[p + "A_log"] = mx.log(-a.astype(mx.float32)).astype(a.dtype)
        conv = weights[p + "conv1d.weight"]
        weights[p + "conv1d.weight"] = conv.reshape(conv.shape[0], 1, conv.shape[-1])
        if p + "in_proj_qkvz.weight" in weights:
            _split_qkvz(weights, kquants, p, config)
        if p + "in_proj_ba.weight" in weights:
            _split_ba(weights, kquants, p, config)
        if arch != "qwen3next" and needs_v_reorder(config):
            _untile_v_heads(weights, kquants, p, config)


def _rows(weights: dict[str, mx.array], module: str) -> list[str]:
    return [f"{module}.{s}" for s in PARTS if f"{module}.{s}" in weights]


def _move(weights: dict[str, mx.array], kquants: dict[str, str], module: str, parts: dict[str, Any]) -> None:
    """Replace ``module``'s arrays by row groups: ``parts`` maps each new module path to the function that
    takes its rows out of an array."""
    kind = kquants.pop(module, None)
    for key in _rows(weights, module):
        value, suffix = weights.pop(key), key.rpartition(".")[2]
        for new, take in parts.items():
            weights[f"{new}.{suffix}"] = take(value)
    if kind is not None:
        kquants.update(dict.fromkeys(parts, kind))


def _split_gate_up(weights: dict[str, mx.array], prefix: str) -> None:
    """Stacked experts' fused ``gate_up_proj`` ``[E, 2I, D]`` (gate rows first) -> gate and up."""
    for key in [k for k in weights if k.startswith(prefix + "gate_up_proj.")]:
        gate, up = mx.split(weights.pop(key), 2, axis=1)
        suffix = key.rpartition(".")[2]
        weights[f"{prefix}gate_proj.{suffix}"], weights[f"{prefix}up_proj.{suffix}"] = gate, up


def _split_attention_qkv(
    weights: dict[str, mx.array], kquants: dict[str, str], module: str, layer: int, c: dict[str, Any]
) -> None:
    q = 2 * c["num_attention_heads"] * c["head_dim"]  # each head's query, then its output gate
    kv = c["num_key_value_heads"] * c["head_dim"]
    attn = f"model.layers.{layer}.self_attn."
    _move(weights, kquants, module, {
        attn + "q_proj": lambda x: x[:q], attn + "k_proj": lambda x: x[q : q + kv],
        attn + "v_proj": lambda x: x[q + kv :],
    })  # fmt: skip


def _split_qkvz(weights: dict[str, mx.array], kquants: dict[str, str], p: str, c: dict[str, Any]) -> None:
    """Older Qwen3-Next files: ``in_proj_qkvz``, rows ``[q, k, v, z]`` per key head -> ``in_proj_qkv``
    (all q, all k, all v) and ``in_proj_z``."""
    hk, dk = c["linear_num_key_heads"], c["linear_key_head_dim"]
    dv = c["linear_num_value_heads"] // hk * c["linear_value_head_dim"]

    def group(x: mx.array, start: int, size: int) -> mx.array:
        return x.reshape(hk, -1, *x.shape[1:])[:, start : start + size].reshape(-1, *x.shape[1:])

    def qkv(x: mx.array) -> mx.array:
        return mx.concatenate([group(x, 0, dk), group(x, dk, dk), group(x, 2 * dk, dv)])

    _move(weights, kquants, p + "in_proj_qkvz", {
        p + "in_proj_qkv": qkv, p + "in_proj_z": lambda x: group(x, 2 * dk + dv, dv),
    })  # fmt: skip


def _split_ba(weights: dict[str, mx.array], kquants: dict[str, str], p: str, c: dict[str, Any]) -> None:
    """Qwen3-Next's ``in_proj_ba``: rows ``[b, a]`` per key head, one of each per value head it serves."""
    hk = c["linear_num_key_heads"]
    per = c["linear_num_value_heads"] // hk

    def half(x: mx.array, start: int) -> mx.array:
        return x.reshape(hk, 2 * per, *x.shape[1:])[:, start : start + per].reshape(-1, *x.shape[1:])

    _move(weights, kquants, p + "in_proj_ba", {p + "in_proj_b": lambda x: half(x, 0),
                                               p + "in_proj_a": lambda x: half(x, per)})  # fmt: skip


def untile(x: mx.array, key_heads: int, value_heads: int, axis: int = 0) -> mx.array:
    """Value heads along ``axis`` from llama.cpp's tiled order back to grouped by key head: the converter
    viewed the axis as ``[key_heads, per, head]`` and swapped the first two; this swaps them back."""
    axis %= x.ndim
    per = value_heads // key_heads
    heads = x.reshape(*x.shape[:axis], per, key_heads, -1, *x.shape[axis + 1 :])
    return heads.swapaxes(axis, axis + 1).reshape(x.shape)


def _untile_v_heads(weights: dict[str, mx.array], kquants: dict[str, str], p: str, c: dict[str, Any]) -> None:
    hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
    key_dim = hk * c["linear_key_head_dim"]

    def v_rows(x: mx.array) -> mx.array:  # rows after q and k
        return mx.concatenate([x[: 2 * key_dim], untile(x[2 * key_dim :], hk, hv)])

    for key in _rows(weights, p + "in_proj_qkv"):
        weights[key] = v_rows(weights[key])
    weights[p + "conv1d.weight"] = v_rows(weights[p + "conv1d.weight"])
    for module in ("in_proj_z", "in_proj_b", "in_proj_a"):
        for key in _rows(weights, p + module):
            weights[key] = untile(weights[key], hk, hv)
    for key in (p + "A_log", p + "dt_bias"):
        weights[key] = untile(weights[key], hk, hv)
    if p + "out_proj" in kquants:
        raise InvalidCheckpoint(f"{p}out_proj: its value-head columns cannot move inside raw K-quant blocks")
    for key in _rows(weights, p + "out_proj"):
        x = weights[key]
        if x.shape[-1] % hv:
            raise InvalidCheckpoint(f"{key}: {x.shape[-1]} columns do not split into {hv} value heads")
        weights[key] = untile(x, hk, hv, axis=-1)
