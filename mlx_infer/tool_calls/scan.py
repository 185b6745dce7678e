"""Incremental scanning helpers: markers split across deltas, and JSON call objects read as they arrive."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence

from mlx_infer.tool_calls.events import Event, ToolCallArgumentsDelta, ToolCallStart, new_call_id

WHITESPACE = " \t\r\n"
NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


def split_at_marker(buffer: str, markers: Sequence[str]) -> tuple[str, str | None, str]:
    """``(before, marker, after)`` around the first marker in ``buffer``; with none,
    ``(safe, None, held)`` where ``held`` is the longest tail that could still begin a marker."""
    found = min(((buffer.find(m), m) for m in markers if m in buffer), default=None)
    if found is not None:
        i, marker = found
        return buffer[:i], marker, buffer[i + len(marker) :]
    hold = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(buffer)), hold, -1):
            if buffer.endswith(m[:k]):
                hold = k
                break
    return buffer[: len(buffer) - hold], None, buffer[len(buffer) - hold :]


class CallObject:
    """One JSON call object (``{"name": ..., "arguments": {...}}``, keys in any order) fed as it arrives.

    It emits ``ToolCallStart`` once the name is known and accepted by ``name_ok``, then the arguments
    text as it grows (arguments that came before the name are sent right after the start). Only the
    object's top level is interpreted; nesting and strings are tracked so braces inside them do not count.
    ``stop_after_arguments``: the object has no closing brace of its own (Mistral's ``name[ARGS]{...}``);
    it is done when the arguments value is.
    """

    def __init__(self, index: int, name_ok: Callable[[str], bool], stop_after_arguments: bool = False):
        self.index = index
        self.name_ok = name_ok
        self.stop_after_arguments = stop_after_arguments
        self.raw = ""
        self.depth = 0
        self.in_string = False
        self.escape = False
        self.expect_key = True
        self.key: str | None = None
        self.string_start = 0
        self.value_start: int | None = None  # start of the top-level value being read
        self.name: str | None = None
        self.arguments: str | None = None  # final arguments text, once the value is complete
        self.started = False
        self.sent = 0  # characters of the arguments already emitted
        self.done = False

    @property
    def rejected(self) -> bool:
        """The object ended (or its name is known) without being a call this parser accepts."""
        return (self.name is not None and not self.name_ok(self.name)) or (self.done and not self.started)

    def feed(self, text: str) -> tuple[list[Event], int]:
        """Consume ``text`` up to the object's end; returns the events and how many characters it used."""
        used = len(text)
        for i, c in enumerate(text):
            self._char(c)
            if self.done:
                used = i + 1
                break
        return self._events(), used

    def _char(self, c: str) -> None:
        pos = len(self.raw)
        self.raw += c
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                if self.depth == 1:
                    self._string_closed(pos + 1)
            return
        if c == '"':
            self.in_string = True
            if self.depth == 1:
                self.string_start = pos
                if not self.expect_key and self.value_start is None:
                    self.value_start = pos
        elif c in "{[":
            self.depth += 1
            if self.depth == 2 and self.value_start is None:
                self.value_start = pos
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1:
                self._value_done(pos + 1)
            elif self.depth <= 0:
                self._primitive_done(pos)
                self.done = True
        elif self.depth == 1:
            if c == ":":
                self.expect_key = False
                self.value_start = None
            elif c == ",":
                self._primitive_done(pos)
                self.expect_key = True
            elif c not in WHITESPACE and not self.expect_key and self.value_start is None:
                self.value_start = pos

    def _string_closed(self, end: int) -> None:
        if self.expect_key:
            try:
                self.key = json.loads(self.raw[self.string_start : end])
            except ValueError:
                self.key = None
        else:
            self._value_done(end)

    def _primitive_done(self, end: int) -> None:
        if not self.expect_key and self.value_start is not None:
            self._value_done(end)

    def _value_done(self, end: int) -> None:
        if self.value_start is None:
            return
        value = self.raw[self.value_start : end].strip()
        self.value_start = None
        if self.key in NAME_KEYS and self.name is None:
            try:
                name = json.loads(value)
            except ValueError:
                name = None
            self.name = name if isinstance(name, str) and name else None
        elif self.key in ARGUMENT_KEYS and self.arguments is None:
            self.arguments = _arguments_text(value)
            if self.stop_after_arguments:
                self.done = True

    def _partial_arguments(self) -> str:
        """The arguments text so far: an object value streams; a string-encoded one waits until complete."""
        if self.arguments is not None:
            return self.arguments
        if self.key in ARGUMENT_KEYS and self.value_start is not None and self.raw[self.value_start] == "{":
            return self.raw[self.value_start :]
        return ""

    def _events(self) -> list[Event]:
        events: list[Event] = []
        if not self.started:
            if self.name is None or not self.name_ok(self.name):
                return events
            self.started = True
            events.append(ToolCallStart(self.index, new_call_id(), self.name))
        arguments = self._partial_arguments()
        if self.done and self.arguments is None:
            arguments = "{}"  # a call without arguments
        if len(arguments) > self.sent:
            events.append(ToolCallArgumentsDelta(self.index, arguments[self.sent :]))
            self.sent = len(arguments)
        return events


def _arguments_text(value: str) -> str:
    """Arguments as JSON object text: an object stays as written; a JSON string holding one is decoded."""
    if value.startswith('"'):
        try:
            decoded = json.loads(value)
        except ValueError:
            return value
        return decoded if isinstance(decoded, str) else value
    return value if value.startswith("{") else "{}"
