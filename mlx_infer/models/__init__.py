"""Model registry keyed by the Hugging Face ``model_type``."""

from __future__ import annotations

import importlib
from types import ModuleType

from mlx_infer.errors import UnsupportedArchitecture

# model_type -> module in this package. Several types share one implementation.
MODEL_TYPES: dict[str, str] = {
    "llama": "llama",
    "mistral": "llama",
    "smollm": "llama",
    "smollm3": "smollm3",
    "ministral3": "ministral3",
    "mistral3": "mistral3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3_moe",
    "glm4_moe": "glm4_moe",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",
    "phi3": "phi3",
    "qwen3_next": "qwen3_next",
    "qwen3_5": "qwen3_5",
    "qwen3_5_text": "qwen3_5",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "gpt_oss": "gpt_oss",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v2": "deepseek_v3",  # V2 / V2.5 / V2-Lite: the same MLA, softmax routing
    "kimi_k2": "deepseek_v3",  # Kimi K2 is DeepSeek V3 in config and weights
    "kimi_k25": "deepseek_v3",  # Kimi K2.5 / K2.6: its text model (the vision tower is left out)
    "glm4_moe_lite": "deepseek_v3",  # GLM-4.7-Flash: DeepSeek V3's layers, GLM's defaults
}

# Encoders (bidirectional, no KV cache): embedding models only, built by mlx_infer.embedding.
ENCODER_TYPES: dict[str, str] = {"bert": "bert"}


def supported_model_types() -> list[str]:
    return sorted(MODEL_TYPES)


def model_module(model_type: str) -> ModuleType:
    """The module (with ``Model`` and ``ModelArgs``) implementing ``model_type``."""
    if model_type in ENCODER_TYPES:
        raise UnsupportedArchitecture(
            f"{model_type!r} is an encoder: it computes embeddings (mlx-infer embed, or serve's "
            "/v1/embeddings), not text"
        )
    try:
        name = MODEL_TYPES[model_type]
    except KeyError:
        raise UnsupportedArchitecture(
            f"unsupported architecture {model_type!r}; supported: {', '.join(supported_model_types())}"
        ) from None
    return importlib.import_module(f"mlx_infer.models.{name}")


def encoder_module(model_type: str) -> ModuleType:
    """The module implementing the encoder ``model_type`` (see ENCODER_TYPES)."""
    return importlib.import_module(f"mlx_infer.models.{ENCODER_TYPES[model_type]}")
