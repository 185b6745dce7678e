"""The incremental parser shared by families whose calls sit between special markers
(GLM-4.5's ``<tool_call>NAME<arg_key>...``, DeepSeek's ``<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>``,
Kimi K2's ``<|tool_call_begin|>...<|tool_call_end|>``).

Each family gives a ``view(body, closed)``: what the text of one call so far (between its begin and end
markers) says: the call's name (None while unknown, or for a malformed call once closed) and the
arguments text so far. The view is a pure function of the body and grows only by appending, so events
are the differences between successive views: streamed and whole-text parses agree by construction.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import NamedTuple

from mlx_infer.tool_calls.base import ToolParser
from mlx_infer.tool_calls.events import Event, TextDelta, ToolCallArgumentsDelta, ToolCallStart, new_call_id
from mlx_infer.tool_calls.scan import WHITESPACE, split_at_marker


class CallView(NamedTuple):
    name: str | None  # None: not known yet (or, once closed, no call at all)
    arguments: str  # arguments text so far (complete once closed)
    call_id: str | None = None  # an id the model wrote itself (Kimi K2), else a fresh one


View = Callable[[str, bool], CallView]


class MarkedCallParser(ToolParser):
    """``starts``: markers that open a region of calls (``call_begin`` among them when a call may
    open without a region marker); ``end``: the region's end marker (None: none)."""

    def __init__(self, starts: Sequence[str], end: str | None, call_begin: str, call_end: str, view: View):
        self.starts = tuple(starts)
        self.end = end
        self.call_begin = call_begin
        self.call_end = call_end
        self.view = view
        self.buf = ""
        self.state = "text"
        self.region_raw = ""
        self.region_calls = 0
        self.body = ""
        self.started = False
        self.sent = 0
        self.next_index = 0

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.state == "text":
            _text(events, self.buf if self.next_index == 0 else self.buf.rstrip(WHITESPACE))
        elif self.state == "call":
            self.body += self.buf
            if self.started:  # cut off inside a call: keep what arrived
                self._call_events(events, closed=False)
                self.next_index += 1
            else:
                raw = self.region_raw if self.region_calls == 0 else ""
                _text(events, raw + self.call_begin + self.body)
        elif self.region_calls == 0:
            _text(events, self.region_raw + self.buf)
        self.buf = ""
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        if self.state == "text":
            return self._in_text(events)
        if self.state == "region":
            return self._in_region(events, final)
        return self._in_call(events)

    def _in_text(self, events: list[Event]) -> bool:
        before, marker, after = split_at_marker(self.buf, self.starts)
        kept = before.rstrip(WHITESPACE)  # whitespace before a call goes (it stays if the call is no call)
        _text(events, kept)
        space = before[len(kept) :]
        if marker is None:
            self.buf = space + after
            return False
        self.state = "region"
        self.region_calls = 0
        if marker == self.call_begin:  # a call with no region marker: the region starts at the call
            self.region_raw, self.buf = space, marker + after
        else:
            self.region_raw, self.buf = space + marker, after
        return True

    def _in_region(self, events: list[Event], final: bool) -> bool:
        head = self.buf.lstrip(WHITESPACE)
        self.region_raw += self.buf[: len(self.buf) - len(head)]
        self.buf = head
        if not head:
            return False
        if self.end is not None and head.startswith(self.end):
            self.buf = head[len(self.end) :]
            self._close_region(events, keep_raw=False)
            return True
        if head.startswith(self.call_begin):
            self.buf = head[len(self.call_begin) :]
            self.state, self.body, self.started, self.sent = "call", "", False, 0
            return True
        waiting = [m for m in (self.end, self.call_begin) if m is not None and m.startswith(head)]
        if waiting and not final:
            return False
        self._close_region(events, keep_raw=True)  # anything else: what follows is text
        return True

    def _close_region(self, events: list[Event], keep_raw: bool) -> None:
        if self.region_calls == 0 and keep_raw:
            _text(events, self.region_raw)
        self.region_raw = ""
        self.state = "text"

    def _in_call(self, events: list[Event]) -> bool:
        before, marker, after = split_at_marker(self.buf, [self.call_end])
        self.body += before
        self.buf = after
        closed = marker is not None
        known = self._call_events(events, closed)
        if not closed:
            return False
        if known:
            self.next_index += 1
            self.region_calls += 1
            self.state = "region"
        else:  # a malformed call: its text is content
            raw = self.region_raw if self.region_calls == 0 else ""
            _text(events, raw + self.call_begin + self.body + self.call_end)
            self.region_raw = ""
            self.state = "text"
        return True

    def _call_events(self, events: list[Event], closed: bool) -> bool:
        view = self.view(self.body, closed)
        if not self.started:
            if view.name is None:
                return False
            self.started = True
            events.append(ToolCallStart(self.next_index, view.call_id or new_call_id(), view.name))
        arguments = view.arguments or ("{}" if closed else "")
        if len(arguments) > self.sent:
            events.append(ToolCallArgumentsDelta(self.next_index, arguments[self.sent :]))
            self.sent = len(arguments)
        return True


def _text(events: list[Event], text: str) -> None:
    if text:
        events.append(TextDelta(text))


def json_arguments(text: str, closed: bool) -> str:
    """Arguments written as JSON, perhaps in a ```json fence: the JSON text so far. Trailing whitespace
    and backticks wait (the fence's end); a fence's opening line waits until it is complete."""
    s = text.lstrip(WHITESPACE)
    if s.startswith("```") or ("```".startswith(s) and s):
        newline = s.find("\n")
        if newline < 0:
            return "" if not closed else s.strip("`").removeprefix("json").strip(WHITESPACE)
        s = s[newline + 1 :].lstrip(WHITESPACE)
    return s.rstrip(WHITESPACE + "`")


def is_name(text: str) -> bool:
    """A plausible function name: no spaces, quotes or braces."""
    return bool(text) and not any(c in text for c in WHITESPACE + "{}[]()\"'<>,")


def dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False)
