"""DeepSeek V3 / R1 and V3.1 tool calls, between the tokenizer's full-width special markers.

V3 / R1 (``deepseek_v3``)::

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {...}
    ```<｜tool▁call▁end｜>
    <｜tool▁call▁begin｜>...<｜tool▁call▁end｜><｜tool▁calls▁end｜>

V3.1 (``deepseek_v31``): ``<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``, the same region
markers. Their chat templates render tools, past calls and tool results themselves.
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

CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
CALLS_END = "<｜tool▁calls▁end｜>"
CALL_BEGIN = "<｜tool▁call▁begin｜>"
CALL_END = "<｜tool▁call▁end｜>"
SEP = "<｜tool▁sep｜>"


def _arguments_json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else dumps(arguments)


def _view_v3(body: str, closed: bool) -> CallView:
    kind, sep, rest = body.partition(SEP)
    if not sep:
        return CallView(None, "")
    newline = rest.find("\n")
    if newline < 0 and not closed:
        return CallView(None, "")
    name = (rest if newline < 0 else rest[:newline]).strip()
    if not is_name(name) or not is_name(kind.strip()):
        return CallView(None, "")
    return CallView(name, "" if newline < 0 else json_arguments(rest[newline + 1 :], closed))


def _view_v31(body: str, closed: bool) -> CallView:
    name, sep, rest = body.partition(SEP)
    if not sep or not is_name(name.strip()):
        return CallView(None, "")
    return CallView(name.strip(), json_arguments(rest, closed))


class DeepSeekV3(ToolFamily):
    name = "deepseek_v3"
    starts = (CALLS_BEGIN, CALL_BEGIN)
    end = CALLS_END
    bare_at_start = False
    markers = (CALL_BEGIN, CALL_END, SEP)

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return MarkedCallParser(self.starts, self.end, CALL_BEGIN, CALL_END, _view_v3)

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{CALL_BEGIN}function{SEP}{name}\n```json\n{_arguments_json(arguments)}\n```{CALL_END}"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return CALLS_BEGIN + "\n".join(self.render_call(n, a) for n, a in calls) + CALLS_END

    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        schema = {"x-guidance": COMPACT_JSON, **parameters}
        sep = marker_literal(SEP, special or {})
        head = f'"function" {sep} {json.dumps(name + chr(10) + "```json" + chr(10), ensure_ascii=False)}'
        return f'{head} %json{json.dumps(schema, ensure_ascii=False)} "\\n```"'

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        begin, end = marker_literal(CALLS_BEGIN, special), marker_literal(CALLS_END, special)
        one = f"{marker_literal(CALL_BEGIN, special)} {call_rule} {marker_literal(CALL_END, special)}"
        calls = 'one ("\\n" one)*' if parallel else "one"
        return f"start: {begin} {calls} {end}\none: {one}"


class DeepSeekV31(DeepSeekV3):
    name = "deepseek_v31"

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return MarkedCallParser(self.starts, self.end, CALL_BEGIN, CALL_END, _view_v31)

    def render_call(self, name: str, arguments: Any) -> str:
        return f"{CALL_BEGIN}{name}{SEP}{_arguments_json(arguments)}{CALL_END}"

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return CALLS_BEGIN + "".join(self.render_call(n, a) for n, a in calls) + CALLS_END

    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        schema = {"x-guidance": COMPACT_JSON, **parameters}
        head = f"{json.dumps(name, ensure_ascii=False)} {marker_literal(SEP, special or {})}"
        return f"{head} %json{json.dumps(schema, ensure_ascii=False)}"

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        begin, end = marker_literal(CALLS_BEGIN, special), marker_literal(CALLS_END, special)
        one = f"{marker_literal(CALL_BEGIN, special)} {call_rule} {marker_literal(CALL_END, special)}"
        return f"start: {begin} {'one+' if parallel else 'one'} {end}\none: {one}"
