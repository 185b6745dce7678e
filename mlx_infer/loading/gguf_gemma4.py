"""llama.cpp's ``gemma4`` GGUF files (Gemma 4's text model) -> models/gemma4.py's config and names.

What llama.cpp's converter writes that other architectures do not:

- per-layer arrays: ``attention.sliding_window_pattern`` (a bool a layer: sliding or global),
  ``attention.head_count_kv`` (when global layers have their own KV head count) and
  ``feed_forward_length`` (when the KV-shared layers' MLP is twice as wide, ``use_double_wide_mlp``);
- two head sizes: ``attention.key_length`` is the global layers', ``key_length_swa`` the sliding ones';
- ``attention.shared_kv_layers`` (the last layers read earlier layers' K/V) and
  ``embedding_length_per_layer_input`` (per-layer inputs; 0 when the model has none);
- proportional RoPE as ``rope_freqs``: factor 1 for the frequency pairs that rotate, 1e30 (no
  rotation) for the rest, used by the global layers only;
- keys doubling as values (``attention_k_eq_v``) as global layers without ``attn_v``;
- the router's input scale and per-expert scale as ``ffn_gate_inp.scale`` / ``ffn_down_exps.scale``,
  the experts' gate and up projections fused as ``ffn_gate_up_exps`` [E, 2I, D], norms stored as
  they are (Gemma 4's RMSNorm multiplies by its weight, so no 1 is added as for Gemma 3).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import MODEL_TENSOR

from mlx_infer.errors import UnsupportedArchitecture
from mlx_infer.loading.gguf_file import TensorInfo

L = "model.layers.{bid}."
# GGUF tensor kind -> the module path models/gemma4.py loads it into (with HF_NAMES for the rest).
NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.FFN_GATE_INP: L + "router.proj",
    # Hugging Face's names of the stacked experts; stacked_experts gives them the model's.
    MODEL_TENSOR.FFN_GATE_UP_EXP: L + "experts.gate_up_proj",
    MODEL_TENSOR.FFN_DOWN_EXP: L + "experts.down_proj",
    MODEL_TENSOR.FFN_PRE_NORM_2: L + "pre_feedforward_layernorm_2",
    MODEL_TENSOR.FFN_POST_NORM_1: L + "post_feedforward_layernorm_1",
    MODEL_TENSOR.FFN_POST_NORM_2: L + "post_feedforward_layernorm_2",
    MODEL_TENSOR.LAYER_OUT_SCALE: L + "layer_scalar",
    MODEL_TENSOR.PER_LAYER_TOKEN_EMBD: "model.embed_tokens_per_layer",
    MODEL_TENSOR.PER_LAYER_MODEL_PROJ: "model.per_layer_model_projection",
    MODEL_TENSOR.PER_LAYER_PROJ_NORM: "model.per_layer_projection_norm",
    MODEL_TENSOR.PER_LAYER_INP_GATE: L + "per_layer_input_gate",
    MODEL_TENSOR.PER_LAYER_PROJ: L + "per_layer_projection",
    MODEL_TENSOR.PER_LAYER_POST_NORM: L + "post_per_layer_input_norm",
}
# (module path's end, GGUF suffix) -> the parameter it is in models/gemma4.py: scales that are not
# a module's weight.
_PARAMETERS = {
    ("router.proj", "scale"): "router.scale",
    ("experts.down_proj", "scale"): "router.per_expert_scale",
    ("layer_scalar", "weight"): "layer_scalar",
}
# A rope_freqs factor at least this large stops its frequency pair (the converter writes 1e30).
_NO_ROTATION = 1e20


def hf_key(module: str, suffix: str) -> str:
    """The weight name of GGUF tensor ``<module>.<suffix>`` (``module`` already a Hugging Face path)."""
    for (end, gguf_suffix), parameter in _PARAMETERS.items():
        if suffix == gguf_suffix and module.endswith(end):
            return module[: -len(end)] + parameter
    return f"{module}.{suffix}"


def stacked_experts(weights: dict[str, mx.array], requantize: dict[str, int]) -> None:
    """The experts under models/gemma4.py's names: ``ffn_gate_up_exps`` [E, 2I, ...] (gate rows, then up
    rows) split into the gate and up projections, for every part (a quantized weight's scales and biases
    alike), and ``ffn_down_exps`` renamed."""
    for name in [n for n in weights if ".experts.gate_up_proj." in n or ".experts.down_proj." in n]:
        module, _, suffix = name.rpartition(".")
        stem, _, proj = module.rpartition(".")
        glu = f"{stem}.switch_glu."
        bits = requantize.pop(module, None)
        if proj == "down_proj":
            parts = {glu + "down_proj": weights.pop(name)}
        else:
            parts = dict(zip((glu + "gate_proj", glu + "up_proj"), mx.split(weights.pop(name), 2, axis=1)))
        for target, value in parts.items():
            weights[f"{target}.{suffix}"] = value
            if bits is not None:
                requantize[target] = bits


def gemma4_config(
    config: dict[str, Any], get: Callable[..., Any], tensors: dict[str, TensorInfo], source: str
) -> None:
    """Fill ``config`` (hf_config's generic keys) with Gemma 4's own from the metadata and tensors."""
    n_layers = config["num_hidden_layers"]
    pattern = get("attention.sliding_window_pattern")
    if not isinstance(pattern, list) or len(pattern) != n_layers:
        raise UnsupportedArchitecture(f"{source}: gemma4 needs a sliding_window_pattern of {n_layers} layers")
    sliding = [bool(s) for s in pattern]
    config["layer_types"] = ["sliding_attention" if s else "full_attention" for s in sliding]

    head_full, head_swa = int(get("attention.key_length")), int(get("attention.key_length_swa"))
    if (get("attention.value_length", head_full), get("attention.value_length_swa", head_swa)) != (
        head_full, head_swa,
    ):  # fmt: skip
        raise UnsupportedArchitecture(f"{source}: gemma4 with value heads unlike key heads is not supported")
    if int(get("rope.dimension_count", head_full)) != head_full or (
        int(get("rope.dimension_count_swa", head_swa)) != head_swa
    ):
        raise UnsupportedArchitecture(
            f"{source}: gemma4 RoPE over part of a head is supported only as rope_freqs gives it"
        )
    kv_heads = _per_layer(get("attention.head_count_kv"), n_layers, "attention.head_count_kv", source)
    heads = _per_layer(get("attention.head_count"), n_layers, "attention.head_count", source)
    if len(set(heads)) != 1:
        raise UnsupportedArchitecture(f"{source}: gemma4 with per-layer query head counts is not supported")
    # The sliding layers' sizes are the config's own; a layer that differs says so in per_layer_config,
    # which models/gemma4.py reads as transformers does.
    base_kv = kv_heads[sliding.index(True)] if any(sliding) else kv_heads[0]
    per_layer: dict[str, dict[str, int]] = {}
    for i, (is_sliding, kv) in enumerate(zip(sliding, kv_heads)):
        over = {} if is_sliding else {"head_dim": head_full}
        if kv != base_kv:
            over["num_key_value_heads"] = kv
        if over:
            per_layer[str(i)] = over
    shared = int(get("attention.shared_kv_layers", 0))
    theta = float(get("rope.freq_base", 1_000_000.0))
    theta_swa = float(get("rope.freq_base_swa", theta))
    config.update(
        head_dim=head_swa,
        global_head_dim=head_full,
        num_key_value_heads=base_kv,
        per_layer_config=per_layer,
        num_kv_shared_layers=shared,
        sliding_window=int(get("attention.sliding_window")),
        hidden_size_per_layer_input=int(get("embedding_length_per_layer_input", 0)),
        rope_parameters={
            # partial_rotary_factor comes from rope_freqs (fold_rope_freqs); 1: every pair rotates.
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 1.0,
                               "rope_theta": theta},  # fmt: skip
            "sliding_attention": {"rope_type": "default", "rope_theta": theta_swa},
        },
    )
    config.pop("rope_scaling", None)
    _mlp_widths(config, get("feed_forward_length"), n_layers - shared, source)
    if get("final_logit_softcapping") is not None:
        config["final_logit_softcapping"] = float(get("final_logit_softcapping"))
    if "per_layer_token_embd.weight" in tensors:
        config["vocab_size_per_layer_input"] = tensors["per_layer_token_embd.weight"].shape[0]
    # Keys double as values where a global layer that computes its K/V has no attn_v.
    config["attention_k_eq_v"] = any(
        not s and f"blk.{i}.attn_k.weight" in tensors and f"blk.{i}.attn_v.weight" not in tensors
        for i, s in enumerate(sliding)
    )
    if get("expert_count"):
        if isinstance(get("expert_feed_forward_length"), list):
            raise UnsupportedArchitecture(f"{source}: gemma4 with per-layer expert widths is not supported")
        config.update(
            enable_moe_block=True,
            num_experts=int(get("expert_count")),
            top_k_experts=int(get("expert_used_count")),
            moe_intermediate_size=int(get("expert_feed_forward_length")),
        )


def fold_rope_freqs(factors: np.ndarray, config: dict[str, Any], source: str) -> None:
    """Proportional RoPE's share of rotating pairs from ``rope_freqs`` (1 then 1e30, a pair each)."""
    rotating = int(np.sum(factors == 1.0))
    if not (np.all(factors[:rotating] == 1.0) and np.all(factors[rotating:] >= _NO_ROTATION)):
        raise UnsupportedArchitecture(f"{source}: gemma4 rope_freqs other than proportional RoPE's")
    config["rope_parameters"]["full_attention"]["partial_rotary_factor"] = rotating / factors.size


def _per_layer(value: Any, n_layers: int, key: str, source: str) -> list[int]:
    if isinstance(value, list):
        if len(value) != n_layers:
            raise UnsupportedArchitecture(f"{source}: {key} has {len(value)} entries for {n_layers} layers")
        return [int(v) for v in value]
    return [int(value)] * n_layers


def _mlp_widths(config: dict[str, Any], widths: Any, first_shared: int, source: str) -> None:
    """llama.cpp's MLP width per layer -> ``intermediate_size`` and ``use_double_wide_mlp`` (the only
    per-layer widths Gemma 4 has: KV-shared layers twice as wide)."""
    widths = _per_layer(widths, config["num_hidden_layers"], "feed_forward_length", source)
    base = widths[0]
    plain = all(w == base for w in widths)
    wide = widths == [base] * first_shared + [2 * base] * (len(widths) - first_shared)
    if not (plain or wide):
        raise UnsupportedArchitecture(f"{source}: gemma4 MLP widths {widths} are not supported")
    config["intermediate_size"] = base
    config["use_double_wide_mlp"] = wide and not plain
