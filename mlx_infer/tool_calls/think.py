"""The ``<think>...</think>`` split (Qwen3, DeepSeek-R1 style) as an incremental parser.

``feed(delta)`` / ``finish()`` return ``ReasoningDelta`` and ``TextDelta`` events. An output that opens
with ``<think>`` reasons until ``</think>``; when the prompt already ends in ``<think>`` (DeepSeek-R1's
template, Qwen3's with thinking forced) the output starts inside the reasoning. Whitespace around the
markers is dropped, as chat UIs show the parts apart. (``mlx_infer.reasoning`` picks the parser per model.)
"""

from __future__ import annotations

from mlx_infer.tool_calls.base import ToolParser
from mlx_infer.tool_calls.events import Event, ReasoningDelta, TextDelta
from mlx_infer.tool_calls.scan import WHITESPACE, split_at_marker

THINK_START = "<think>"
THINK_END = "</think>"


class ReasoningParser(ToolParser):
    def __init__(self, in_reasoning: bool = False, start: str = THINK_START, end: str = THINK_END):
        self.start, self.end = start, end
        self.state = "reasoning" if in_reasoning else "opening"
        self.skip_space = in_reasoning  # whitespace right after a marker is dropped
        self.buf = ""

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self.buf and self.state != "reasoning":  # trailing whitespace of the reasoning is dropped
            events.append(TextDelta(self.buf))
        self.buf = ""
        return events

    def _advance(self, events: list[Event], final: bool) -> bool:
        if self.skip_space:
            self.buf = self.buf.lstrip(WHITESPACE)
            if not self.buf:
                return False
            self.skip_space = False
        if self.state == "opening":
            head = self.buf.lstrip(WHITESPACE)
            if head.startswith(self.start):
                self.buf, self.state, self.skip_space = head[len(self.start) :], "reasoning", True
                return True
            if not final and (not head or self.start.startswith(head)):
                return False
            self.state = "content"
            return True
        if self.state == "content":
            if self.buf:
                events.append(TextDelta(self.buf))
                self.buf = ""
            return False
        before, marker, after = split_at_marker(self.buf, [self.end])
        if marker is not None:
            if before.rstrip(WHITESPACE):
                events.append(ReasoningDelta(before.rstrip(WHITESPACE)))
            self.buf, self.state, self.skip_space = after, "content", True
            return True
        # Trailing whitespace waits: it is dropped if the end marker follows it.
        kept = before.rstrip(WHITESPACE)
        if kept:
            events.append(ReasoningDelta(kept))
        self.buf = before[len(kept) :] + after
        return False


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside a ``<think>`` block."""
    tail = prompt_text.rstrip(WHITESPACE)
    return tail.endswith(THINK_START)
