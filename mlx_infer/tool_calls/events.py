"""The events an output parser emits while generated text arrives, and what they add up to.

Surface-neutral: the OpenAI chat route turns them into ``delta.content`` / ``delta.reasoning_content`` /
``delta.tool_calls`` chunks, other surfaces into their own content blocks.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class TextDelta:
    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    text: str


@dataclass(frozen=True)
class ToolCallStart:
    """A call begins: its name is known, its arguments follow as ``ToolCallArgumentsDelta`` fragments."""

    index: int  # 0, 1, ... in the order the calls appear in one output
    id: str
    name: str


@dataclass(frozen=True)
class ToolCallArgumentsDelta:
    index: int
    arguments: str  # a fragment of the call's JSON arguments text


Event = TextDelta | ReasoningDelta | ToolCallStart | ToolCallArgumentsDelta


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: str = ""  # JSON text, as OpenAI's ``function.arguments``


@dataclass
class ParsedOutput:
    """A whole output split into its parts."""

    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCall] = field(default_factory=list)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def assemble(events: Iterable[Event], into: ParsedOutput | None = None) -> ParsedOutput:
    """Accumulate events into (reasoning, content, tool calls)."""
    out = into if into is not None else ParsedOutput()
    for e in events:
        if isinstance(e, TextDelta):
            out.content += e.text
        elif isinstance(e, ReasoningDelta):
            out.reasoning += e.text
        elif isinstance(e, ToolCallStart):
            out.tool_calls.append(ToolCall(e.id, e.name))
        else:
            out.tool_calls[e.index].arguments += e.arguments
    return out
