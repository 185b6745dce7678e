"""The grammar that forces a tool call (``tool_choice`` ``required`` or a named function): the family's
own call syntax around each function's parameter schema, so the forced call always parses and validates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.base import ToolFamily


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool (``{"type": "function", "function": {...}}``)."""
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise InvalidRequest("each tool must be {'type': 'function', 'function': {'name': ...}}", "tools")
    return function


def forced_call_grammar(
    family: ToolFamily,
    tools: Sequence[Mapping[str, Any]],
    name: str | None = None,
    parallel: bool = True,
    special: Mapping[str, int] | None = None,
) -> str:
    """Lark text admitting only calls of ``tools`` (only ``name`` when given: then exactly one call).

    ``special``: marker text -> token id, for markers the tokenizer has as one special token.
    """
    functions = [function_of(t) for t in tools]
    if name is not None:
        functions = [f for f in functions if f["name"] == name]
        if not functions:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    if not functions:
        raise InvalidRequest("tool_choice 'required' needs at least one tool", "tool_choice")
    rules = [
        f"call_{i}: {family.call_rule(f['name'], f.get('parameters') or {'type': 'object'}, special or {})}"
        for i, f in enumerate(functions)
    ]
    call = "call: " + " | ".join(f"call_{i}" for i in range(len(functions)))
    start = family.call_grammar("call", parallel and name is None, special or {})
    return "\n".join([start, call, *rules])


def forced_call_constraint(
    family: ToolFamily,
    tools: Sequence[Mapping[str, Any]],
    name: str | None = None,
    parallel: bool = True,
    special: Mapping[str, int] | None = None,
):
    """``forced_call_grammar`` as the engine's ``ConstraintSpec`` (a Lark grammar)."""
    from mlx_infer.constraints import ConstraintSpec

    return ConstraintSpec("lark", forced_call_grammar(family, tools, name, parallel, special))
