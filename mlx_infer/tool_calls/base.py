"""The incremental tool-call parser shared by the JSON families, and the family description.

A family says which markers open (and close) a region of calls, whether bare JSON at the very start of
an output counts as a call, how calls are written back into a prompt for templates that cannot render
them, and the call syntax a grammar forces. The parser splits text into ``TextDelta`` and tool-call
events as it arrives; feeding the whole text at once gives the same events in fewer pieces, so the
streamed and the non-streamed answer agree by construction.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping, Sequence
from types import MappingProxyType
from typing import Any

from mlx_infer.tool_calls.events import Event, TextDelta
from mlx_infer.tool_calls.scan import WHITESPACE, CallObject, split_at_marker

# llguidance's JSON layout for forced calls: json.dumps's separators, no free whitespace (a small model
# sampling at temperature 1 could otherwise spend its tokens on blank lines), keys in schema order.
# The request's tools' JSON-schema ``parameters`` by tool name: families whose calls write values as bare
# text (GLM) type them by it.
Parameters = Mapping[str, Mapping[str, Any]]
NO_PARAMETERS: Parameters = MappingProxyType({})
COMPACT_JSON = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

# Between the calls of one region: list brackets and separators.
_BETWEEN_CALLS = WHITESPACE + "[],;"


class ToolParser:
    """Incremental: ``feed(delta)`` then ``finish()``; both return events.

    Subclasses keep the text not yet consumed in ``self.buf`` and implement ``_advance(events, final)``:
    one step over it, True while it made progress (``final``: no more text will come).
    """

    buf: str = ""

    def feed(self, text: str) -> list[Event]:
        self.buf += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        raise NotImplementedError

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._advance(events, final):
            pass
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        raise NotImplementedError


class JsonCallParser(ToolParser):
    """Calls as JSON objects inside marked regions (``<tool_call>...</tool_call>``, ``[TOOL_CALLS][...]``),
    or as bare JSON at the start of the output when the family allows it.

    Inside a marked region any name is a call (the model said so); bare JSON is a call only when its name
    is one of the request's tools, so a JSON answer the user asked for stays content.
    """

    def __init__(
        self,
        starts: Sequence[str],
        end: str | None,
        bare_at_start: bool,
        tool_names: Collection[str],
        any_name_in_regions: bool = True,
    ):
        self.starts = tuple(starts)
        self.end = end
        self.bare_at_start = bare_at_start
        self.tool_names = frozenset(tool_names)
        self.any_name_in_regions = any_name_in_regions
        self.buf = ""
        self.state = "text"
        self.at_start = True  # nothing but whitespace seen yet
        self.region_raw = ""  # text of the current region, given back as content if it holds no call
        self.region_calls = 0
        self.region_bare = False
        self.call: CallObject | None = None
        self.next_index = 0

    # ---- driving ---------------------------------------------------------------------------------
    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.state == "text":
            _text(events, self.buf if self.next_index == 0 else self.buf.rstrip(WHITESPACE))
        elif self.region_calls == 0 and not (self.call and self.call.started):
            _text(events, self.region_raw + self.buf)  # a region cut off before any call: plain text
        self.buf = ""
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        if self.state == "text":
            return self._in_text(events, final)
        if self.state == "region":
            return self._in_region(events, final)
        return self._in_call(events)

    # ---- states ----------------------------------------------------------------------------------
    def _in_text(self, events: list[Event], final: bool) -> bool:
        if self.at_start and self.bare_at_start:
            stripped = self.buf.lstrip(WHITESPACE)
            if not stripped:
                return False
            if stripped[0] in "{[":
                self._open_region(self.buf[: len(self.buf) - len(stripped)], bare=True)
                self.buf = stripped
                return True
        before, marker, after = split_at_marker(self.buf, self.starts)
        if before.strip(WHITESPACE):
            self.at_start = False
        # Whitespace waits for what follows: before a call or at the end of an answer with calls it goes.
        kept = before.rstrip(WHITESPACE)
        _text(events, kept)
        if marker is None:
            self.buf = before[len(kept) :] + after
            return False
        self._open_region(marker, bare=False)
        self.buf = after
        return True

    def _open_region(self, raw: str, bare: bool) -> None:
        self.state = "region"
        self.region_raw = raw
        self.region_calls = 0
        self.region_bare = bare
        self.at_start = False

    def _in_region(self, events: list[Event], final: bool) -> bool:
        skipped = len(self.buf) - len(self.buf.lstrip(_BETWEEN_CALLS))
        self.region_raw += self.buf[:skipped]
        self.buf = self.buf[skipped:]
        if not self.buf:
            return False
        if self.end is not None and not self.region_bare:
            if self.buf.startswith(self.end):
                self.buf = self.buf[len(self.end) :]
                self._close_region(events, keep_raw=False)
                return True
            if self.end.startswith(self.buf) and not final:
                return False
        if self.buf[0] == "{":
            trusted = self.any_name_in_regions and not self.region_bare
            name_ok = (lambda _: True) if trusted else self.tool_names.__contains__
            self.call = CallObject(self.next_index, name_ok)
            self.state = "call"
            return True
        # Anything else ends the region: what follows is text.
        self._close_region(events, keep_raw=True)
        return True

    def _close_region(self, events: list[Event], keep_raw: bool) -> None:
        if self.region_calls == 0 and keep_raw:
            _text(events, self.region_raw)
        self.region_raw = ""
        self.state = "text"

    def _in_call(self, events: list[Event]) -> bool:
        call = self.call
        assert call is not None
        new, used = call.feed(self.buf)
        self.region_raw += self.buf[:used]
        self.buf = self.buf[used:]
        events.extend(new)
        if call.rejected:
            # No call after all (no name, or bare JSON naming no tool): its text is content.
            _text(events, self.region_raw if self.region_calls == 0 else call.raw)
            self.region_raw = ""
            self.call = None
            self.state = "text"
            return True
        if not call.done:
            return False
        self.next_index += 1
        self.region_calls += 1
        self.call = None
        self.state = "region"
        return True


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextDelta(text))


class ToolFamily:
    """How one model family writes tool calls.

    ``start`` / ``end``: the markers of a region of calls; ``bare_at_start``: bare JSON calls at the
    start of the output count too; ``arguments_key``: the key the family's calls use for arguments;
    ``markers``: the family's other markers (inside calls), which a forcing grammar names by token id
    where the tokenizer has them as special tokens.
    """

    name = "generic"
    starts: tuple[str, ...] = ()
    end: str | None = None
    bare_at_start = True
    arguments_key = "arguments"
    markers: tuple[str, ...] = ()

    def parser(self, tool_names: Collection[str], parameters: Parameters = NO_PARAMETERS) -> ToolParser:
        return JsonCallParser(self.starts, self.end, self.bare_at_start, tool_names)

    # ---- prompts, for chat templates that do not render tools themselves ----------------------------
    def tools_prompt(self, tools: Sequence[Mapping[str, Any]]) -> str:
        """A system-prompt section that lists ``tools`` and asks for calls in this family's syntax."""
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        return (
            "You have access to the following functions:\n"
            f"{listing}\n\n"
            "To call functions, answer with only a JSON object "
            f'{{"name": <function name>, "{self.arguments_key}": <arguments object>}}, '
            "or a JSON list of such objects for several calls."
        )

    def render_calls(self, calls: Sequence[tuple[str, Any]]) -> str:
        """``(name, arguments)`` pairs written as this family writes calls (history for the prompt)."""
        objects = [self.call_json(name, arguments) for name, arguments in calls]
        return objects[0] if len(objects) == 1 else "[" + ", ".join(objects) + "]"

    def call_json(self, name: str, arguments: Any) -> str:
        return json.dumps({"name": name, self.arguments_key: arguments}, ensure_ascii=False)

    # ---- forcing a call -------------------------------------------------------------------------------
    def call_rule(
        self, name: str, parameters: Mapping[str, Any], special: Mapping[str, int] | None = None
    ) -> str:
        """A Lark rule body for one call of ``name`` whose arguments follow the JSON schema ``parameters``
        (``special``: as for ``call_grammar``)."""
        schema = {
            "x-guidance": COMPACT_JSON,
            "type": "object",
            "properties": {
                "name": {"const": name},
                self.arguments_key: moved_schema(parameters, f"#/properties/{self.arguments_key}"),
            },
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }
        return "%json" + json.dumps(schema, ensure_ascii=False)

    def call_grammar(self, call_rule: str, parallel: bool, special: Mapping[str, int]) -> str:
        """Lark rules for ``start``: this family's calls around ``call_rule`` (one call object).
        ``special``: ids of the family's markers that are single special tokens of the tokenizer."""
        if parallel:
            return f'start: {call_rule} | "[" {call_rule} (", " {call_rule})* "]"'
        return f"start: {call_rule}"


def moved_schema(schema: Any, pointer: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/$defs/X``, ``#`` for recursion) rewritten for its new place
    ``pointer`` inside a larger schema, as a forced call's grammar embeds a tool's parameters (pydantic
    writes every nested model and enum as a ``$defs`` reference)."""
    if isinstance(schema, Mapping):
        moved = {k: moved_schema(v, pointer) for k, v in schema.items()}
        ref = schema.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            moved["$ref"] = pointer + ref[1:]
        return moved
    if isinstance(schema, list):
        return [moved_schema(v, pointer) for v in schema]
    return schema


def property_schema(parameters: Mapping[str, Any], key: str) -> dict[str, Any]:
    """The schema of one property of ``parameters``, standing alone (families that write each argument
    value on its own, as Gemma 3 and GLM do): references it makes into ``parameters`` resolve against a
    copy of ``parameters`` carried in its ``$defs``."""
    pointer = "#/$defs/mlx_infer_parameters"
    own = (parameters.get("properties") or {})[key]
    moved = moved_schema(own, pointer)
    if moved == own:  # no references: no copy
        return {"x-guidance": COMPACT_JSON, **own}
    whole = moved_schema(parameters, pointer)
    return {"x-guidance": COMPACT_JSON, **moved, "$defs": {"mlx_infer_parameters": whole}}


def marker_literal(marker: str, special: Mapping[str, int]) -> str:
    """A Lark terminal for ``marker``: the special token itself when the tokenizer has one, else its text."""
    if marker in special:
        return f"<[{special[marker]}]>"
    return json.dumps(marker)
