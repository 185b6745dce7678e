"""Reading RoPE settings out of a Hugging Face config.

transformers >= 5 nests ``rope_theta`` and the scaling under ``rope_parameters``; older configs use
``rope_theta`` and ``rope_scaling``. Scaling types the models do not implement are refused rather than
silently ignored, because ignoring them gives plausible but wrong logits at long context.
"""

from __future__ import annotations

from typing import Any

from mlx_infer.errors import UnsupportedArchitecture

# What models.base.rope_frequencies / rope_scale implement.
SUPPORTED_SCALING = ("default", "linear", "llama3", "yarn")


def scaling_type(scaling: dict[str, Any] | None) -> str:
    if not scaling:
        return "default"
    return str(scaling.get("rope_type", scaling.get("type", "default")))


def resolve_rope(
    model_type: str,
    theta: float | None,
    scaling: dict[str, Any] | None,
    parameters: dict[str, Any] | None,
    default_theta: float,
    supported: tuple[str, ...] = SUPPORTED_SCALING,
) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` from either config layout; raises on an unsupported scaling."""
    if parameters:
        theta = theta if theta is not None else parameters.get("rope_theta")
        scaling = scaling if scaling is not None else parameters
    if scaling_type(scaling) not in supported:
        raise UnsupportedArchitecture(
            f"{model_type}: rope scaling {scaling_type(scaling)!r} is not supported "
            f"(supported: {', '.join(supported)})"
        )
    return (default_theta if theta is None else float(theta)), scaling
