"""Kimi K2 tool calls::

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}
    <|tool_call_end|>...<|tool_calls_section_end|>

``functions.NAME:IDX`` is the call's id as well (the chat template writes past calls back with their
ids), so it is kept as the id. Kimi K2's template renders tools, past calls and tool results itself.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import (
    COMPACT_JSON,
    NO_PARAMETERS,
    Parameters,
    ToolFamily,
    ToolParser,
    marker_literal,
)
from mlx_infer.tool_calls.marked import CallView, MarkedCallParser, dumps, is_name, json_arguments

SECTION_BEGIN = "<|tool_calls_section_begin|>"
SECTION_BEGIN_ALT = "<|tool_call_section_begin|>"  # a spelling some outputs use
SECTION_END = "<|tool_calls_section_end|>"
CALL_BEGIN = "<|tool_call_begin|>"
CALL_END = "<|tool_call_end|>"
ARGUMENT_BEGIN = "<|tool_call_argument_begin|>"


def _view(body: str, closed: bool) -> CallView:
    head, sep, rest = body.partition(ARGUMENT_BEGIN)
    head = head.strip()
    if not sep:
        return CallView(None, "")
    name = head.removeprefix("functions.")
    stem, colon, index = name.rpartition(":")
    if colon and index.isdigit():
        name = stem
    if not is_name(name):
        return CallView(None, "")
    return CallView(name, json_arguments(rest, closed), head if colon and index.isdigit() else None)


class KimiK2(ToolFamily):
    name = "kimi_k2"
    starts = (SECTION_BEGIN, SECTION_BEGIN_ALT, CALL_BEGIN)
    end = SECTION_END
    bare_at_start = False
    markers = (CALL_BEGIN, CALL_END, ARGUMENT_BEGIN)

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return MarkedCallParser(self.starts, self.end, CALL_BEGIN, CALL_END, _view)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return (
            SECTION_BEGIN
            + "".join(
                f"{CALL_BEGIN}functions.{n}:{i}{ARGUMENT_BEGIN}"
                f"{a if isinstance(a, str) else dumps(a)}{CALL_END}"
                for i, (n, a) in enumerate(calls)
            )
            + SECTION_END
        )

    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        schema = {"x-guidance": COMPACT_JSON, **parameters}
        head = json.dumps(f"functions.{name}:", ensure_ascii=False)
        arg = marker_literal(ARGUMENT_BEGIN, special or {})
        return f"{head} /[0-9]+/ {arg} %json{json.dumps(schema, ensure_ascii=False)}"

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        begin, end = marker_literal(SECTION_BEGIN, special), marker_literal(SECTION_END, special)
        one = f"{marker_literal(CALL_BEGIN, special)} {call_rule} {marker_literal(CALL_END, special)}"
        return f"start: {begin} {'one+' if parallel else 'one'} {end}\none: {one}"
