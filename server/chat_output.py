"""Parsed chat output in OpenAI's chat completion shapes (the final ``message`` and the stream deltas),
and handed to the other surfaces' builders (Anthropic's content blocks, the Responses API's items)."""

from __future__ import annotations

from typing import Any, Protocol

from mlx_infer.tool_calls import (
    Event,
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCallArgumentsDelta,
    ToolCallStart,
)


def finish_reason(parsed: ParsedOutput, engine_reason: str | None) -> str | None:
    """``tool_calls`` when the answer ended by itself with calls in it (OpenAI's value), else the engine's."""
    return "tool_calls" if parsed.tool_calls and engine_reason == "stop" else engine_reason


def message(parsed: ParsedOutput) -> dict[str, Any]:
    body: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning:
        body["reasoning_content"] = parsed.reasoning
    if parsed.tool_calls:
        body["content"] = parsed.content or None  # OpenAI sends null content beside calls
        body["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in parsed.tool_calls
        ]
    return body


def delta(event: Event) -> dict[str, Any]:
    """One event as a chunk's ``delta``: a call's id, type and name come first with empty arguments,
    then its argument fragments, as OpenAI streams them."""
    if isinstance(event, TextDelta):
        return {"content": event.text}
    if isinstance(event, ReasoningDelta):
        return {"reasoning_content": event.text}
    if isinstance(event, ToolCallStart):
        call = {"index": event.index, "id": event.id, "type": "function"}
        return {"tool_calls": [{**call, "function": {"name": event.name, "arguments": ""}}]}
    assert isinstance(event, ToolCallArgumentsDelta)
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]}


class AnswerBuilder(Protocol):
    """What a surface builds its answer from, each method returning the stream events it makes."""

    def text(self, text: str) -> list[str]: ...
    def reasoning(self, text: str) -> list[str]: ...
    def call(self, call_id: str, name: str) -> list[str]: ...
    def call_arguments(self, fragment: str) -> list[str]: ...


def build(events: list[Event], builder: AnswerBuilder) -> list[str]:
    """The parser's events given to ``builder`` in order; the stream events they make."""
    out: list[str] = []
    for event in events:
        if isinstance(event, TextDelta):
            out += builder.text(event.text)
        elif isinstance(event, ReasoningDelta):
            out += builder.reasoning(event.text)
        elif isinstance(event, ToolCallStart):
            out += builder.call(event.id, event.name)
        else:
            out += builder.call_arguments(event.arguments)
    return out
