"""The tool-call families by name, and the one a model's chat template and tokenizer point to."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.base import ToolFamily
from mlx_infer.tool_calls.deepseek import DeepSeekV3, DeepSeekV31
from mlx_infer.tool_calls.gemma3 import Gemma3
from mlx_infer.tool_calls.generic import Generic
from mlx_infer.tool_calls.glm45 import Glm45
from mlx_infer.tool_calls.hermes import Hermes
from mlx_infer.tool_calls.kimi_k2 import KimiK2
from mlx_infer.tool_calls.llama3 import Llama3
from mlx_infer.tool_calls.mistral import Mistral
from mlx_infer.tool_calls.smollm2 import SmolLM2

FAMILIES: dict[str, ToolFamily] = {
    f.name: f
    for f in (
        Hermes(),
        SmolLM2(),
        Llama3(),
        Mistral(),
        Gemma3(),
        Glm45(),
        DeepSeekV3(),
        DeepSeekV31(),
        KimiK2(),
        Generic(),
    )
}
ALIASES = {
    "qwen": "hermes",
    "qwen2.5": "hermes",
    "qwen3": "hermes",
    "llama3": "llama3_json",
    "pythonic": "gemma3",
    "glm4_moe": "glm45",
    "glm47": "glm45",
    "deepseek_r1": "deepseek_v3",
    "deepseek_v3.1": "deepseek_v31",
    "kimi": "kimi_k2",
}
CHOICES = ("auto", "none", *FAMILIES, *ALIASES)


def template_sources(templates: str | Mapping[str, str] | None) -> str:
    """All of a model's chat template text (named templates joined), for feature checks."""
    if templates is None:
        return ""
    return templates if isinstance(templates, str) else "\n".join(templates.values())


def detect(template: str, has_token: Any = lambda token: False) -> ToolFamily:
    """The family a chat template (and the tokenizer's special tokens, via ``has_token``) points to."""
    # GLM-4.5+ shares Hermes's <tool_call> but writes key/value pairs in it.
    if "<arg_key>" in template or has_token("<arg_key>"):
        return FAMILIES["glm45"]
    if "<｜tool▁sep｜>" in template or has_token("<｜tool▁sep｜>"):
        # V3 / R1 write "function<｜tool▁sep｜>NAME" and a ```json fence; V3.1 "NAME<｜tool▁sep｜>ARGS".
        v3 = "```json" in template or "'function<｜tool▁sep｜>'" in template
        return FAMILIES["deepseek_v3" if v3 or not template else "deepseek_v31"]
    if "<|tool_calls_section_begin|>" in template or has_token("<|tool_calls_section_begin|>"):
        return FAMILIES["kimi_k2"]
    if "<tool_call>" in template:
        return FAMILIES["hermes"]
    if "[TOOL_CALLS]" in template or has_token("[TOOL_CALLS]"):
        return FAMILIES["mistral"]
    if "<|python_tag|>" in template or ("<|start_header_id|>" in template and has_token("<|python_tag|>")):
        return FAMILIES["llama3_json"]
    if "<start_of_turn>" in template:
        return FAMILIES["gemma3"]
    if "SmolLM" in template:
        return FAMILIES["smollm2"]
    return FAMILIES["generic"]


def resolve(name: str, tokenizer: Any) -> ToolFamily | None:
    """``--tool-call-parser NAME`` for a loaded tokenizer: ``auto`` detects, ``none`` turns parsing off."""
    if name == "none":
        return None
    if name == "auto":
        has_token = lambda t: tokenizer.token_to_id(t) is not None  # noqa: E731
        return detect(template_sources(tokenizer.chat_template), has_token)
    family = FAMILIES.get(ALIASES.get(name, name))
    if family is None:
        raise InvalidRequest(f"unknown tool-call parser {name!r}; choose from {', '.join(CHOICES)}")
    return family


def model_parsers(tokenizer: Any, tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
    """``(tool family or None, reasoning parser name or None)`` for a loaded model, from the serve flags."""
    from mlx_infer import reasoning

    template = template_sources(tokenizer.chat_template)
    has_token = lambda t: tokenizer.token_to_id(t) is not None  # noqa: E731
    return resolve(tool_call_parser, tokenizer), reasoning.resolve(reasoning_parser, template, has_token)
