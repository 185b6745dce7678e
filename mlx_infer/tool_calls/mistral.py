"""Mistral: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (v3 tokenizers: Mistral 7B v0.3,
Nemo, Small 3.1) and ``[TOOL_CALLS]name[ARGS]{...}`` (v11+ tokenizers: Small 3.2, Magistral, Devstral)."""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from mlx_infer.tool_calls.base import (
    NO_PARAMETERS,
    JsonCallParser,
    Parameters,
    ToolFamily,
    ToolParser,
    marker_literal,
)
from mlx_infer.tool_calls.events import Event
from mlx_infer.tool_calls.scan import CallObject

TOOL_CALLS = "[TOOL_CALLS]"
ARGS = "[ARGS]"


class _MistralParser(JsonCallParser):
    """The JSON-list form via the shared parser; a region that starts with a bare name is the v11 form."""

    def _in_region(self, events: list[Event], final: bool) -> bool:
        head = self.buf.lstrip()
        if head.startswith(TOOL_CALLS):  # the v11 form repeats the marker before each call
            self.region_raw += self.buf[: len(self.buf) - len(head) + len(TOOL_CALLS)]
            self.buf = head[len(TOOL_CALLS) :]
            return True
        if head and TOOL_CALLS.startswith(head) and not final:
            return False
        if head[:1].isalpha() or head[:1] == "_":
            i = self.buf.find(ARGS)
            if i < 0:
                j = head.find("[")
                name, tail = (head, "") if j < 0 else (head[:j], head[j:])
                if not final and all(c.isalnum() or c in "_-." for c in name) and ARGS.startswith(tail):
                    return False  # the name is still arriving
                return super()._in_region(events, final)
            name = self.buf[:i].strip()
            self.region_raw += self.buf[: i + len(ARGS)]
            self.buf = self.buf[i + len(ARGS) :]
            self.call = CallObject(self.next_index, lambda _: True, stop_after_arguments=True)
            events.extend(self.call.feed(f'{{"name": {json.dumps(name)}, "arguments": ')[0])
            self.state = "call"
            return True
        return super()._in_region(events, final)


class Mistral(ToolFamily):
    name = "mistral"
    starts = (TOOL_CALLS,)
    end = None
    bare_at_start = False

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return _MistralParser(self.starts, self.end, self.bare_at_start, tool_names)

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        return TOOL_CALLS + "[" + ", ".join(self.call_json(n, a) for n, a in calls) + "]"

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        calls = f'{call_rule} (", " {call_rule})*' if parallel else call_rule
        return f'start: {marker_literal(TOOL_CALLS, special)} "[" {calls} "]"'
