"""Hermes / Qwen2.5 / Qwen3 / SmolLM3: ``<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>``,
one block per call. Their chat templates render the tools and past calls themselves."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import ToolFamily, marker_literal


class Hermes(ToolFamily):
    name = "hermes"
    starts = ("<tool_call>",)
    end = "</tool_call>"
    bare_at_start = False

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "\n".join(f"<tool_call>\n{self.call_json(n, a)}\n</tool_call>" for n, a in calls)

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        start, end = marker_literal("<tool_call>", special), marker_literal("</tool_call>", special)
        block = f'{start} "\\n" {call_rule} "\\n" {end}'
        return f'start: block ("\\n" block)*\nblock: {block}' if parallel else f"start: {block}"
