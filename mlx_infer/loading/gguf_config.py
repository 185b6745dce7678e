"""GGUF metadata -> a Hugging Face style ``config.json`` dict for the model zoo.

Keys follow llama.cpp's ``gguf.constants.Keys`` (``{arch}.embedding_length`` ...); what llama.cpp
hard-codes per architecture instead of storing (Gemma 3's sliding-window pattern, its local RoPE
base) is hard-coded here the same way.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mlx_infer.errors import InvalidCheckpoint, UnsupportedArchitecture
from mlx_infer.loading import gguf_hybrid
from mlx_infer.loading.gguf_file import TensorInfo
from mlx_infer.loading.gguf_gemma4 import gemma4_config

# GGUF general.architecture -> Hugging Face model_type.
MODEL_TYPES = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "gemma3": "gemma3_text",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "glm4moe": "glm4_moe",
    # llama.cpp's "mistral3" is the text model of Mistral 3 / Ministral 3 (YaRN, query temperature).
    "mistral3": "ministral3",
    "gpt-oss": "gpt_oss",
    "deepseek2": "deepseek_v3",  # DeepSeek V2/V3/R1, Kimi K2
    "gemma4": "gemma4_text",  # the text model (llama.cpp keeps vision and audio in an mmproj file)
    **gguf_hybrid.MODEL_TYPES,  # Qwen3-Next, Qwen3.5
}
# Metadata that may be a per-layer array, and the architectures whose config reads such arrays.
_PER_LAYER_KEYS = ("attention.head_count", "attention.head_count_kv", "feed_forward_length")
_PER_LAYER_ARRAYS = {"gemma4"}


def hf_config(metadata: dict[str, Any], tensors: dict[str, TensorInfo], source: str) -> dict[str, Any]:
    arch = metadata.get("general.architecture")
    if arch not in MODEL_TYPES:
        raise UnsupportedArchitecture(
            f"{source}: GGUF architecture {arch!r} is not supported; "
            f"supported: {', '.join(sorted(MODEL_TYPES))}"
        )

    def get(key: str, default: Any = None) -> Any:
        return metadata.get(f"{arch}.{key}", default)

    arrays = [key for key in _PER_LAYER_KEYS if isinstance(get(key), list)]
    if arrays and arch not in _PER_LAYER_ARRAYS:
        raise UnsupportedArchitecture(f"{source}: per-layer {arrays[0]} is not supported for {arch}")

    def first(key: str, default: Any = None) -> Any:  # an array's first layer (the extras read the rest)
        value = get(key, default)
        return value[0] if isinstance(value, list) else value

    try:
        n_heads = first("attention.head_count")
        config: dict[str, Any] = {
            "model_type": MODEL_TYPES[arch],
            "hidden_size": int(get("embedding_length")),
            "num_hidden_layers": int(get("block_count")),
            "intermediate_size": int(first("feed_forward_length", 0)),
            "num_attention_heads": int(n_heads),
            "num_key_value_heads": int(first("attention.head_count_kv", n_heads)),
            "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-5)),
            "max_position_embeddings": int(get("context_length", 4096)),
            "vocab_size": tensors["token_embd.weight"].shape[0],
            "tie_word_embeddings": "output.weight" not in tensors,
        }
    except (TypeError, KeyError) as e:
        raise InvalidCheckpoint(f"{source}: GGUF metadata lacks {e} for architecture {arch}") from None
    if get("rope.freq_base") is not None:
        config["rope_theta"] = float(get("rope.freq_base"))
    if get("attention.key_length") is not None:
        config["head_dim"] = int(get("attention.key_length"))
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    config["rope_scaling"] = _rope_scaling(get)
    _ARCH_EXTRAS.get(arch, lambda *_: None)(config, get, head_dim)
    for key, tensor in _TENSOR_FLAGS.get(arch, {}).items():
        config[key] = tensor in tensors
    if arch == "gemma4":
        try:
            gemma4_config(config, get, tensors, source)
        except (TypeError, KeyError) as e:
            raise InvalidCheckpoint(f"{source}: GGUF metadata lacks {e} for architecture {arch}") from None
    return config


def _rope_scaling(get) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = float(get("rope.scaling.factor", 1.0))
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind, "factor": factor}
    if get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
    if get("rope.scaling.original_context_length") is not None:
        scaling["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    return scaling


def llama3_scaling(factors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """Recover Llama 3's ``rope_scaling`` from the per-frequency factors llama.cpp stores (``rope_freqs``).

    llama.cpp keeps only the factors; Llama 3.x always used low/high frequency factors 1 and 4 and an
    original context of 8192, so those are assumed, and the result is checked against the factors.
    Returns None when they do not match that scheme.
    """
    scaling = {
        "rope_type": "llama3",
        "factor": float(factors.max()),
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    dims = np.arange(0, head_dim, 2, dtype=np.float64) / head_dim
    wavelen = 2 * np.pi * theta**dims
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    expected = np.where(
        wavelen < high_wavelen,
        1.0,
        np.where(wavelen > low_wavelen, scaling["factor"], 1 / ((1 - smooth) / scaling["factor"] + smooth)),
    )
    if factors.shape != expected.shape or not np.allclose(factors, expected, rtol=1e-3):
        return None
    return scaling


def _gemma3(config: dict[str, Any], get, head_dim: int) -> None:
    config["sliding_window"] = int(get("attention.sliding_window", 4096))
    config["sliding_window_pattern"] = 6  # llama.cpp: hparams.set_swa_pattern(6)
    config["rope_local_base_freq"] = float(get("rope.freq_base_swa", 10000.0))
    config["rope_theta"] = config.get("rope_theta", 1_000_000.0)
    # llama.cpp: the 27B model (62 layers) scales queries by 1/sqrt(hidden / heads), the others by head_dim.
    big = config["num_hidden_layers"] == 62
    scalar = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
    config["query_pre_attn_scalar"] = scalar
    if get("final_logit_softcapping") is not None:
        config["final_logit_softcapping"] = float(get("final_logit_softcapping"))


def _qwen3moe(config: dict[str, Any], get, head_dim: int) -> None:
    config["num_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length", config["intermediate_size"]))
    # llama.cpp's qwen3moe always normalizes the chosen experts' weights.
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))


def _phi3(config: dict[str, Any], get, head_dim: int) -> None:
    if get("attention.sliding_window") is not None:
        config["sliding_window"] = int(get("attention.sliding_window"))
    if get("rope.scaling.original_context_length") is not None:
        config["original_max_position_embeddings"] = int(get("rope.scaling.original_context_length"))
    rotary = get("rope.dimension_count")
    if rotary is not None:
        config["partial_rotary_factor"] = int(rotary) / head_dim


def _deepseek2(config: dict[str, Any], get, head_dim: int) -> None:
    """MLA sizes and the DeepSeek V3 router. An MLA GGUF's key/value lengths are the latent row's
    (kv_lora_rank + rope, kv_lora_rank); the per-head ones are the ``*_mla`` keys (in older files, the
    plain ones)."""
    rope_dim = int(get("rope.dimension_count"))
    q_lora_rank = get("attention.q_lora_rank")
    config.update(
        q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
        kv_lora_rank=int(get("attention.kv_lora_rank")),
        qk_rope_head_dim=rope_dim,
        qk_nope_head_dim=int(get("attention.key_length_mla", get("attention.key_length"))) - rope_dim,
        v_head_dim=int(get("attention.value_length_mla", get("attention.value_length"))),
        moe_intermediate_size=int(get("expert_feed_forward_length", config["intermediate_size"])),
        n_routed_experts=get("expert_count"),
        num_experts_per_tok=int(get("expert_used_count", 1)),
        n_shared_experts=int(get("expert_shared_count", 0)),
        routed_scaling_factor=float(get("expert_weights_scale", 1.0)),
        norm_topk_prob=bool(get("expert_weights_norm", False)),
        n_group=int(get("expert_group_count", 1)),
        topk_group=int(get("expert_group_used_count", 1)),
        first_k_dense_replace=int(get("leading_dense_block_count", 0)),
        rope_interleave=True,  # llama.cpp rotates DeepSeek's (even, odd) pairs as the weights have them
    )
    # llama.cpp reads a missing gating function as DeepSeek V2's softmax routing.
    sigmoid = get("expert_gating_func") == 2
    config["scoring_func"] = "sigmoid" if sigmoid else "softmax"
    grouped = config["n_group"] > 1
    config["topk_method"] = "noaux_tc" if sigmoid else "group_limited_greedy" if grouped else "greedy"
    scaling = config["rope_scaling"]
    if scaling is not None:
        for key in ("beta_fast", "beta_slow"):
            if get(f"rope.scaling.yarn_{key}") is not None:
                scaling[key] = float(get(f"rope.scaling.yarn_{key}"))
        if get("rope.scaling.yarn_log_multiplier") is not None:
            # The converter stores 0.1 * mscale_all_dim and drops mscale; llama.cpp's rope then applies no
            # attention factor of its own, which is transformers' result for mscale == mscale_all_dim.
            mscale = float(get("rope.scaling.yarn_log_multiplier")) / 0.1
            scaling.update(mscale=mscale, mscale_all_dim=mscale)


def _gpt_oss(config: dict[str, Any], get, head_dim: int) -> None:
    config["num_local_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["intermediate_size"] = int(get("expert_feed_forward_length"))
    config["sliding_window"] = int(get("attention.sliding_window", 128))
    # Layer types: llama.cpp's set_swa_pattern(2) (sliding layers first) is models/gpt_oss.py's default.
    if config["rope_scaling"] is not None:
        # gpt-oss's own config: YaRN with beta 32/1 and no rounding of the ramp's ends (truncate false).
        fast, slow = get("rope.scaling.yarn_beta_fast", 32.0), get("rope.scaling.yarn_beta_slow", 1.0)
        config["rope_scaling"].update(beta_fast=float(fast), beta_slow=float(slow), truncate=False)


def _glm4moe(config: dict[str, Any], get, head_dim: int) -> None:
    # llama.cpp counts the multi-token-prediction layers in block_count; they come after the model's.
    config["num_hidden_layers"] -= int(get("nextn_predict_layers", 0))
    config["partial_rotary_factor"] = int(get("rope.dimension_count", head_dim // 2)) / head_dim
    config["n_routed_experts"] = int(get("expert_count"))
    config["num_experts_per_tok"] = int(get("expert_used_count"))
    config["moe_intermediate_size"] = int(get("expert_feed_forward_length"))
    config["n_shared_experts"] = int(get("expert_shared_count", 1))
    config["first_k_dense_replace"] = int(get("leading_dense_block_count", 1))
    config["routed_scaling_factor"] = float(get("expert_weights_scale", 1.0))
    config["norm_topk_prob"] = bool(get("expert_weights_norm", True))
    config["n_group"] = int(get("expert_group_count", 1))
    config["topk_group"] = int(get("expert_group_used_count", 1))


def _mistral3(config: dict[str, Any], get, head_dim: int) -> None:
    scaling = config.get("rope_scaling")
    if scaling is None or scaling["rope_type"] != "yarn":
        return
    for name in ("beta_fast", "beta_slow"):
        if get(f"rope.scaling.yarn_{name}") is not None:
            scaling[name] = float(get(f"rope.scaling.yarn_{name}"))
    # The converter keeps mscale_all_dim (as yarn_log_mul) and drops mscale, which Mistral sets to 1.
    if get("rope.scaling.yarn_log_multiplier") is not None:
        scaling["mscale"], scaling["mscale_all_dim"] = 1.0, float(get("rope.scaling.yarn_log_multiplier"))
    if get("attention.temperature_scale") is not None:
        scaling["llama_4_scaling_beta"] = float(get("attention.temperature_scale"))


# Config flags llama.cpp leaves to the presence of a tensor: arch -> {config key: tensor of layer 0}.
_TENSOR_FLAGS = {
    "glm4moe": {"use_qk_norm": "blk.0.attn_q_norm.weight", "attention_bias": "blk.0.attn_q.bias"},
}
_ARCH_EXTRAS = {
    "gemma3": _gemma3, "qwen3moe": _qwen3moe, "phi3": _phi3, "glm4moe": _glm4moe, "mistral3": _mistral3,
    "gpt-oss": _gpt_oss, "deepseek2": _deepseek2,
    **{arch: functools.partial(gguf_hybrid.hf_config, arch=arch) for arch in gguf_hybrid.ARCHS},
}
