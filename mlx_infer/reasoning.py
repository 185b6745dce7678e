"""Reasoning (``<think>...</think>``, Qwen3 / DeepSeek-R1 style) split from the answer: which parser a
model gets (``--reasoning-parser``) and the request options around it. The incremental parser itself
is ``ReasoningParser`` (mlx_infer/tool_calls/think.py), beside the tool-call parsers it feeds.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.think import THINK_END, THINK_START, ReasoningParser, starts_in_reasoning

CHOICES = ("auto", "none", "think", "qwen3", "deepseek_r1")
__all__ = ["CHOICES", "ReasoningParser", "detect", "resolve", "starts_in_reasoning", "template_kwargs"]


def detect(template: str, has_token: Any = lambda token: False) -> str | None:
    """``"think"`` when the chat template or the vocabulary knows ``<think>``, else None."""
    if THINK_START in template or THINK_END in template or has_token(THINK_START):
        return "think"
    return None


def resolve(name: str, template: str, has_token: Any = lambda token: False) -> str | None:
    """``--reasoning-parser NAME``: ``auto`` detects, ``none`` turns the split off; the other names are
    all the ``<think>`` format."""
    if name not in CHOICES:
        raise InvalidRequest(f"unknown reasoning parser {name!r}; choose from {', '.join(CHOICES)}")
    if name == "auto":
        return detect(template, has_token)
    return None if name == "none" else "think"


def template_kwargs(value: Mapping[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` as template variables; the names the renderer sets itself are refused."""
    reserved = {"messages", "tools", "documents", "add_generation_prompt"}
    kwargs = dict(value or {})
    clash = sorted(reserved & set(kwargs))
    if clash:
        raise InvalidRequest(f"chat_template_kwargs cannot set {', '.join(clash)}", "chat_template_kwargs")
    return kwargs
