"""Tool calls in generated text, per model family, for every API surface.

Per model: ``resolve(name, tokenizer)`` picks the family (``--tool-call-parser``; ``auto`` reads the chat
template and tokenizer) and ``mlx_infer.reasoning.resolve`` the reasoning split. Per request:
``prepare_chat`` checks the tool fields and returns a ``ChatPlan``: ``render(messages)`` gives the prompt
ids (tools and past calls written in for templates that cannot render them), ``constraint`` the grammar
that forces a call for ``tool_choice`` required / a named function, ``parser(prompt_ids)`` one
``OutputParser`` per choice: ``feed(delta)`` / ``finish()`` return ``TextDelta``, ``ReasoningDelta``,
``ToolCallStart`` and ``ToolCallArgumentsDelta`` events. ``parse_output`` is the whole-text form.
"""

from mlx_infer.tool_calls.base import ToolFamily, ToolParser
from mlx_infer.tool_calls.events import (
    Event,
    ParsedOutput,
    ReasoningDelta,
    TextDelta,
    ToolCall,
    ToolCallArgumentsDelta,
    ToolCallStart,
    assemble,
)
from mlx_infer.tool_calls.forcing import forced_call_constraint, forced_call_grammar
from mlx_infer.tool_calls.output import OutputParser, parse_output
from mlx_infer.tool_calls.prompt import ChatPlan, ToolChoice, prepare_chat
from mlx_infer.tool_calls.registry import CHOICES, FAMILIES, detect, model_parsers, resolve

__all__ = [
    "CHOICES",
    "ChatPlan",
    "FAMILIES",
    "Event",
    "OutputParser",
    "ParsedOutput",
    "ReasoningDelta",
    "TextDelta",
    "ToolCall",
    "ToolCallArgumentsDelta",
    "ToolCallStart",
    "ToolChoice",
    "ToolFamily",
    "ToolParser",
    "assemble",
    "detect",
    "forced_call_constraint",
    "forced_call_grammar",
    "model_parsers",
    "parse_output",
    "prepare_chat",
    "resolve",
]
