"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: ``{"name": ..., "parameters": {...}}`` as the whole answer,
optionally after ``<|python_tag|>``, several separated by ``; ``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import ToolFamily


class Llama3(ToolFamily):
    name = "llama3_json"
    starts = ("<|python_tag|>",)
    end = None
    bare_at_start = True
    arguments_key = "parameters"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "; ".join(self.call_json(n, a) for n, a in calls)

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        # Bare JSON, as the templates ask for; <|python_tag|> is for the built-in tools.
        return f'start: {call_rule} ("; " {call_rule})*' if parallel else f"start: {call_rule}"
