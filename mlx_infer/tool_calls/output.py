"""One request's output parser: reasoning split first, then tool calls in the answer part."""

from __future__ import annotations

from collections.abc import Collection

from mlx_infer.tool_calls.base import NO_PARAMETERS, Parameters, ToolFamily, ToolParser
from mlx_infer.tool_calls.events import (
    Event,
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
    assemble,
)
from mlx_infer.tool_calls.think import ReasoningParser


class OutputParser:
    """``feed(delta) -> events``, ``finish() -> events``; ``result`` holds what they add up to.

    ``family`` None: no tool parsing (no tools, or ``tool_choice: none``); ``reasoning`` None: no split.
    ``parallel`` False keeps only the first call. ``parameters``: the tools' parameter schemas by name,
    for families that type argument values by them. ``forced``: a grammar makes the answer calls and
    nothing else, so any text is the family's markup of a call cut off (by max_tokens) before it could
    be parsed: it is dropped rather than shown as content.
    """

    def __init__(
        self,
        family: ToolFamily | None = None,
        tool_names: Collection[str] = (),
        reasoning: str | None = None,
        in_reasoning: bool = False,
        parallel: bool = True,
        parameters: Parameters = NO_PARAMETERS,
        forced: bool = False,
    ):
        self.reasoning = ReasoningParser(in_reasoning) if reasoning else None
        self.tools: ToolParser | None = family.parser(tool_names, parameters) if family is not None else None
        self.parallel = parallel
        self.forced = forced
        self.result = ParsedOutput()

    def feed(self, text: str) -> list[Event]:
        return self._route(self.reasoning.feed(text) if self.reasoning else [TextDelta(text)], final=False)

    def finish(self) -> list[Event]:
        return self._route(self.reasoning.finish() if self.reasoning else [], final=True)

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.result.tool_calls)

    def _route(self, events: list[Event], final: bool) -> list[Event]:
        out: list[Event] = []
        for e in events:
            if isinstance(e, TextDelta) and self.tools is not None:
                out.extend(self.tools.feed(e.text))
            elif not (isinstance(e, TextDelta) and not e.text):
                out.append(e)
        if final and self.tools is not None:
            out.extend(self.tools.finish())
        if self.forced:
            out = [e for e in out if not isinstance(e, TextDelta)]
        if not self.parallel:
            calls = (ToolCallStart, ToolCallArgumentsDelta)
            out = [e for e in out if not isinstance(e, calls) or e.index == 0]
        out = _merge(out)
        assemble(out, self.result)
        return out


def _merge(events: list[Event]) -> list[Event]:
    """Adjacent text (or reasoning, or one call's argument) pieces as one event."""
    merged: list[Event] = []
    for e in events:
        last = merged[-1] if merged else None
        if isinstance(e, TextDelta) and isinstance(last, TextDelta):
            merged[-1] = TextDelta(last.text + e.text)
        elif isinstance(e, ReasoningDelta) and isinstance(last, ReasoningDelta):
            merged[-1] = ReasoningDelta(last.text + e.text)
        elif (
            isinstance(e, ToolCallArgumentsDelta)
            and isinstance(last, ToolCallArgumentsDelta)
            and e.index == last.index
        ):
            merged[-1] = ToolCallArgumentsDelta(e.index, last.arguments + e.arguments)
        else:
            merged.append(e)
    return merged


def parse_output(
    text: str,
    family: ToolFamily | None = None,
    tool_names: Collection[str] = (),
    reasoning: str | None = None,
    in_reasoning: bool = False,
    parallel: bool = True,
    parameters: Parameters = NO_PARAMETERS,
) -> ParsedOutput:
    """The whole-text parse: (reasoning, content, tool_calls) of a complete output."""
    parser = OutputParser(family, tool_names, reasoning, in_reasoning, parallel, parameters)
    parser.feed(text)
    parser.finish()
    return parser.result
