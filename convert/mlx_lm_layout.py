"""The names and config keys mlx-lm reads, where they differ from the source checkpoint's.

Composites: mlx-lm's ``mistral3``, ``qwen3_5``, ``qwen3_5_moe``, ``gemma4`` and ``kimi_k25`` keep the text
model as ``language_model`` and build it from ``text_config`` alone: its per-layer quantization entries are
looked up under ``language_model.``-prefixed module paths, and the head is tied by
``text_config.tie_word_embeddings`` (not the composite's flag, which transformers 5 and mlx-infer follow).
The output therefore names weights and per-layer entries as mlx-lm saves such a model and records the
tie the converted model has in ``text_config``; mlx-infer's loader reads both forms.

Layout: mlx-lm's qwen3_next reads a checkpoint whose experts are stacked (as the output's are) as one its
sanitize has already seen, so the output holds that model's other weights in mlx-lm's layout too (the
convolution as nn.Conv1d's, the zero-centred norms with their one added), which mlx-infer's loader
recognises by the convolution's shape, as mlx-lm does.

Config keys: transformers 5 saves some settings only in a newer form that many of mlx-lm's models do not
read, falling back to a default without a word (a wrong RoPE base, a wrong layer pattern). The output keeps
the source's keys and adds the older equivalents mlx-lm reads, derived from them, so every reader gets
the same model: RoPE's ``rope_theta`` / ``partial_rotary_factor`` / ``rope_scaling`` beside
``rope_parameters``, Qwen3.5's ``full_attention_interval`` beside ``layer_types``, Gemma 4's
``global_head_dim`` / ``num_global_key_value_heads`` beside ``per_layer_config``. A setting the older
keys cannot express (layer types that do not repeat, global layers of different shapes) gets no key.
(mlx-lm's ministral3 slides a window only on layers ``layer_types`` names and needs one full-attention
layer, so a config whose ``sliding_window`` slides every layer, as transformers reads it, differs there
past the window.)
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from mlx_infer.models import qwen3_next

from .weights import Group

Config = dict[str, Any]

# model_type -> the prefix mlx-lm's model puts before the text model's own names.
NESTED_TEXT_MODEL = {
    "mistral3": "language_model.",
    "qwen3_5": "language_model.",
    "qwen3_5_moe": "language_model.",
    "gemma4": "language_model.",
    "kimi_k25": "language_model.",
}
# Types whose experts the output stacks (switch_mlp), which mlx-lm takes for a checkpoint its sanitize has
# already seen, and so reads every other weight in its own layout too: the convolution as nn.Conv1d's
# [C, K, 1] and the zero-centred norms with their one added.
SANITIZED_LAYOUT = {"qwen3_next"}
# RoPE settings transformers 5 keeps inside rope_parameters and older configs (mlx-lm) at the top.
_ROPE_TOP_LEVEL = ("rope_theta", "partial_rotary_factor")


def prefix(config: Config) -> str:
    return NESTED_TEXT_MODEL.get(config.get("model_type", ""), "")


def rename_groups(groups: list[Group], config: Config) -> None:
    """Every output tensor under mlx-lm's name (and layout), in place."""
    if config.get("model_type") in SANITIZED_LAYOUT:
        for g in groups:
            g.tensors = {name: qwen3_next.to_mlx_lm_layout(name, v) for name, v in g.tensors.items()}
    if p := prefix(config):
        for g in groups:
            g.tensors = {p + name: value for name, value in g.tensors.items()}


def mlx_lm_config(
    config: Config, quantization: Config | None, model: nn.Module
) -> tuple[Config, Config | None]:
    """(the source config, the quantization key) as mlx-lm reads them for this model type."""
    p = prefix(config)
    if not p:
        return with_older_keys(config), quantization
    text = {**config["text_config"], "tie_word_embeddings": model.args.tie_word_embeddings}
    if quantization is not None:
        quantization = {p + k if isinstance(v, dict) else k: v for k, v in quantization.items()}
    # mlx-lm's gemma4 gives its text model the composite's vocab_size (default 262144), which
    # transformers 5 keeps in text_config only.
    vocab = {"vocab_size": config.get("vocab_size") or text["vocab_size"]}
    return {**config, **vocab, "text_config": with_older_keys(text)}, quantization


def with_older_keys(text: Config) -> Config:
    """``text`` (a text model's config) plus the older keys mlx-lm reads that it lacks."""
    derived = {**_rope_keys(text), **_attention_interval(text), **_global_attention(text)}
    return {**text, **{k: v for k, v in derived.items() if text.get(k) is None}}


def _rope_keys(text: Config) -> Config:
    params = text.get("rope_parameters")
    if not isinstance(params, dict) or "rope_theta" not in params:  # absent, or one dict per layer type
        return {}
    out = {k: params[k] for k in _ROPE_TOP_LEVEL if k in params}
    scaled = params.get("rope_type", params.get("type", "default")) != "default"
    # None rather than absent: mlx-lm's glm4_moe requires the key
    out["rope_scaling"] = {k: v for k, v in params.items() if k not in _ROPE_TOP_LEVEL} if scaled else None
    return out


def _attention_interval(text: Config) -> Config:
    """Qwen3.5 / Qwen3-Next: mlx-lm places full attention on every ``full_attention_interval``-th layer."""
    types = text.get("layer_types")
    if not types or "linear_attention" not in types:
        return {}
    n = types.index("full_attention") + 1 if "full_attention" in types else 0
    pattern = ["full_attention" if n and (i + 1) % n == 0 else "linear_attention" for i in range(len(types))]
    return {"full_attention_interval": n} if n and pattern == list(types) else {}


def _global_attention(text: Config) -> Config:
    """Gemma 4: mlx-lm sizes every full-attention layer by ``global_head_dim`` (and, with
    ``attention_k_eq_v``, ``num_global_key_value_heads``), where transformers 5 saves per-layer entries."""
    per_layer, types = text.get("per_layer_config"), text.get("layer_types")
    if not per_layer or not types:
        return {}
    full, sliding = ([per_layer.get(str(i), {}) for i, k in enumerate(types) if k == kind]
                     for kind in ("full_attention", "sliding_attention"))
    if not full or any(o != full[0] for o in full) or any(sliding):
        return {}  # global layers differ among themselves, or a sliding layer differs from head_dim
    kv_heads = full[0].get("num_key_value_heads", text.get("num_key_value_heads"))
    if kv_heads != text.get("num_key_value_heads") and not text.get("attention_k_eq_v"):
        return {}  # mlx-lm's global layers take num_global_key_value_heads only with attention_k_eq_v
    out = {"global_head_dim": full[0].get("head_dim", text.get("head_dim"))}
    return out | ({"num_global_key_value_heads": kv_heads} if text.get("attention_k_eq_v") else {})
