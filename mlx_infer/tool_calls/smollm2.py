"""SmolLM2: ``<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>``, a JSON list in one block.

SmolLM2's chat template ignores ``tools``; the system prompt below is the one its model card gives for
function calling, so the tools reach the model in the form it was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import ToolFamily, marker_literal

_PROMPT = "\n".join(
    [
        "You are an expert in composing functions. You are given a question and a set of possible functions.",
        "Based on the question, you will need to make one or more function/tool calls to achieve the "
        "purpose.",
        "If none of the functions can be used, point it out and refuse to answer.",
        "If the given question lacks the parameters required by the function, also point it out.",
        "",
        "You have access to the following tools:",
        "<tools>{tools}</tools>",
        "",
        "The output MUST strictly adhere to the following format, and NO other text MUST be included.",
        "The example format is as follows. Please make sure the parameter type is correct. If no "
        "function call is needed, please make the tool calls an empty list '[]'.",
        "<tool_call>[",
        '{{"name": "func_name1", "arguments": {{"argument1": "value1", "argument2": "value2"}}}},',
        "... (more tool calls as required)",
        "]</tool_call>",
    ]
)


class SmolLM2(ToolFamily):
    name = "smollm2"
    starts = ("<tool_call>",)
    end = "</tool_call>"
    bare_at_start = False

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return _PROMPT.format(tools=json.dumps(list(tools), ensure_ascii=False))

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "<tool_call>[" + ", ".join(self.call_json(n, a) for n, a in calls) + "]</tool_call>"

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        start, end = marker_literal("<tool_call>", special), marker_literal("</tool_call>", special)
        calls = f'{call_rule} (", " {call_rule})*' if parallel else call_rule
        return f'start: {start} "[" {calls} "]" {end}'
