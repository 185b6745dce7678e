"""GLM-4.5 / 4.6 / 4.7 tool calls: one block per call, arguments as key/value pairs::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) The chat template writes strings bare and everything
else as JSON, so a value is typed by the request's schema, as GLM's own parsers (vLLM's and SGLang's
glm4_moe) do: a parameter declared ``"type": "string"`` keeps its text (``123`` stays the string "123"),
any other value that parses as JSON is that JSON value, else a string. (A quoted JSON string, as the
forcing grammar and :meth:`Glm45.render_calls` write strings, is that string whatever the declared
type.) Arguments stream a pair at a time. The GLM templates render tools, past calls and tool results
themselves.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import (
    NO_PARAMETERS,
    Parameters,
    ToolFamily,
    ToolParser,
    marker_literal,
    property_schema,
)
from mlx_infer.tool_calls.marked import CallView, MarkedCallParser, dumps, is_name
from mlx_infer.tool_calls.scan import WHITESPACE

CALL_BEGIN = "<tool_call>"
CALL_END = "</tool_call>"
ARG_KEY = "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _value(text: str, schema: Mapping[str, Any]) -> Any:
    try:
        value = json.loads(text)
    except ValueError:
        return text
    # A declared string stays text, unless it is a quoted JSON string (as a forced call's grammar and
    # render_calls write strings): that string.
    if schema.get("type") == "string" and not isinstance(value, str):
        return text
    return value


def _viewer(parameters: Parameters) -> Callable[[str, bool], CallView]:
    """The call view, typing each value by its tool's declared ``parameters``."""

    def view(body: str, closed: bool) -> CallView:
        body = body.lstrip(WHITESPACE)
        cut = min((i for i in (body.find("\n"), body.find("<")) if i >= 0), default=-1)
        if cut < 0 and not closed:
            return CallView(None, "")
        name = (body if cut < 0 else body[:cut]).strip(WHITESPACE)
        if not is_name(name):
            return CallView(None, "")
        properties = (parameters.get(name) or {}).get("properties") or {}
        pairs = []
        for key, text in _PAIR.findall(body[len(name) :]):
            key = key.strip()
            pairs.append(f"{dumps(key)}: {dumps(_value(text, properties.get(key) or {}))}")
        return CallView(name, "{" + ", ".join(pairs) + ("}" if closed else ""))

    return view


class Glm45(ToolFamily):
    name = "glm45"
    starts = (CALL_BEGIN,)
    end = None
    bare_at_start = False
    markers = (ARG_KEY, "</arg_key>", "<arg_value>", "</arg_value>")

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return MarkedCallParser(self.starts, self.end, CALL_BEGIN, CALL_END, _viewer(parameters))

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """GLM-4.5's layout; every value as JSON (strings quoted), which reads back the same."""
        blocks = []
        for name, arguments in calls:
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    arguments = {}
            items = arguments.items() if isinstance(arguments, dict) else []
            pairs = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{dumps(v)}</arg_value>\n" for k, v in items)
            blocks.append(f"{CALL_BEGIN}{name}\n{pairs}{CALL_END}")
        return "\n".join(blocks)

    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        """``NAME\\n`` then the pairs: required keys in order, then any optional ones; values as JSON."""
        properties = parameters.get("properties") or {}
        required = [k for k in properties if k in set(parameters.get("required") or [])]
        optional = [k for k in properties if k not in required]

        def lit(marker: str) -> str:
            return marker_literal(marker, special or {})

        def pair(key: str) -> str:
            key_text = json.dumps(key, ensure_ascii=False)
            head = f'{lit(ARG_KEY)} {key_text} {lit("</arg_key>")} "\\n" {lit("<arg_value>")}'
            schema = json.dumps(property_schema(parameters, key), ensure_ascii=False)
            return f'{head} %json{schema} {lit("</arg_value>")} "\\n"'

        parts = [" ".join(pair(k) for k in required)] if required else []
        if optional:
            parts.append("(" + " | ".join(pair(k) for k in optional) + ")*")
        return f"{json.dumps(name + chr(10), ensure_ascii=False)} {' '.join(parts)}".rstrip()

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        block = f"{marker_literal(CALL_BEGIN, special)} {call_rule} {marker_literal(CALL_END, special)}"
        return f'start: block ("\\n" block)*\nblock: {block}' if parallel else f"start: {block}"
