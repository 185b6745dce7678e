"""Gemma 3: Python-style calls, ``[get_weather(city="Paris"), get_time(zone="CET")]`` as the whole
answer, or inside a ```tool_code fence, as Google's function-calling guide for Gemma 3 prompts for.

Gemma 3's chat template ignores ``tools``; the system prompt below is the guide's. Calls are read with
Python's own parser (``ast``), never evaluated. A call is emitted once its list or fence is complete.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import NO_PARAMETERS, Parameters, ToolFamily, ToolParser, property_schema
from mlx_infer.tool_calls.events import Event, TextDelta, ToolCallArgumentsDelta, ToolCallStart, new_call_id
from mlx_infer.tool_calls.scan import WHITESPACE, split_at_marker

FENCE_START = "```tool_code"
FENCE_END = "```"
_JSON_NAMES = {"true": True, "false": False, "null": None}  # JSON literals the grammar may produce

_PROMPT = (
    "You have access to functions. If you decide to invoke any of the function(s), you MUST put it in "
    "the format of\n"
    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\n"
    "You SHOULD NOT include any other text in the response if you call a function.\n"
    "{tools}"
)


def parse_calls(source: str) -> list[tuple[str, dict[str, Any]]] | None:
    """``[f(a=1), g(b="x")]``, ``f(a=1)`` or ``print(f(a=1))`` lines -> [(name, arguments)]; None if
    the text is not only calls with literal keyword arguments."""
    try:
        tree = ast.parse(source.strip(), mode="exec")
    except SyntaxError:
        return None
    calls: list[ast.expr] = []
    for statement in tree.body:
        if not isinstance(statement, ast.Expr):
            return None
        node = statement.value
        calls.extend(node.elts if isinstance(node, ast.List) else [node])
    out = []
    for node in calls:
        if isinstance(node, ast.Call) and _dotted(node.func) == "print" and len(node.args) == 1:
            node = node.args[0]
        name = _dotted(node.func) if isinstance(node, ast.Call) else None
        if name is None or node.args:
            return None
        try:
            out.append((name, {k.arg: _literal(k.value) for k in node.keywords if k.arg}))
        except ValueError:
            return None
    return out or None


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _list_end(text: str) -> int | None:
    """Index after the bracket that closes the list ``text`` opens (quotes respected), or None."""
    depth, quote, escape = 0, "", False
    for i, c in enumerate(text):
        if quote:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == quote:
                quote = ""
        elif c in "\"'":
            quote = c
        elif c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


class _PythonicParser(ToolParser):
    def __init__(self) -> None:
        self.buf = ""
        self.at_start = True
        self.fenced = False  # inside a ```tool_code fence
        self.index = 0

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.buf:
            calls = parse_calls(self.buf) if self.fenced else None
            self._emit(events, calls, (FENCE_START if self.fenced else "") + self.buf)
        self.buf = ""
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        if self.fenced:
            body, marker, after = split_at_marker(self.buf, [FENCE_END])
            if marker is None:
                return False
            self._emit(events, parse_calls(body), FENCE_START + body + FENCE_END)
            self.buf, self.fenced = after, False
            return True
        if self.at_start:
            stripped = self.buf.lstrip(WHITESPACE)
            if not stripped:
                return False
            self.at_start = False
            if stripped[0] == "[":
                end = _list_end(stripped)
                if end is None and not final:
                    self.at_start = True
                    return False
                end = end or len(stripped)
                lead = self.buf[: len(self.buf) - len(stripped)]
                self._emit(events, parse_calls(stripped[:end]), lead + stripped[:end])
                self.buf = stripped[end:]
                return True
        before, marker, after = split_at_marker(self.buf, [FENCE_START])
        if before:
            events.append(TextDelta(before))
        self.buf = after
        if marker is None:
            if final and after:
                events.append(TextDelta(after))
                self.buf = ""
            return False
        self.fenced = True
        return True

    def _emit(self, events: list[Event], calls: list[tuple[str, dict]] | None, raw: str) -> None:
        if calls is None:
            if raw:
                events.append(TextDelta(raw))
            return
        for name, arguments in calls:
            events.append(ToolCallStart(self.index, new_call_id(), name))
            events.append(ToolCallArgumentsDelta(self.index, json.dumps(arguments, ensure_ascii=False)))
            self.index += 1


class Gemma3(ToolFamily):
    name = "gemma3"

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return _PythonicParser()

    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        return _PROMPT.format(tools=json.dumps(list(tools), ensure_ascii=False, indent=2))

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return "[" + ", ".join(_python_call(n, a) for n, a in calls) + "]"

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        calls = f'{call_rule} (", " {call_rule})*' if parallel else call_rule
        return f'start: "[" {calls} "]"'

    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        """One call ``name(key=value, ...)`` in Lark: the required keys in order, then any optional
        ones; each value a JSON value of its schema (JSON's true/false/null read back as Python's)."""
        properties = parameters.get("properties") or {}
        required = [k for k in properties if k in set(parameters.get("required") or [])]
        optional = [k for k in properties if k not in required]

        def pair(key: str) -> str:
            return f'"{key}=" %json{json.dumps(property_schema(parameters, key))}'

        parts = [' ", " '.join(pair(k) for k in required)] if required else []
        if optional:
            choice = "(" + " | ".join(pair(k) for k in optional) + ")"
            parts.append(f'(", " {choice})*' if required else f'({choice} (", " {choice})*)?')
        return f'{json.dumps(name + "(")} {" ".join(parts)} ")"'


def _python_call(name: str, arguments: Any) -> str:
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            arguments = {}
    items = arguments.items() if isinstance(arguments, dict) else []
    # JSON values: the syntax the forcing grammar uses, and that parse_calls reads back.
    return f"{name}(" + ", ".join(f"{k}={json.dumps(v, ensure_ascii=False)}" for k, v in items) + ")"
