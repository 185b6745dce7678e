"""The grammar that forces a tool call (``tool_choice`` ``required`` or a named function): the family's
own call syntax around each function's parameter schema, so the forced call always parses and validates."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.base import ToolFamily

# A function that leaves out its parameters takes none (OpenAI's words): its forced call's arguments are {}.
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}


def function_of(tool: Mapping[str, Any]) -> Mapping[str, Any]:
    """The ``function`` object of an OpenAI tool (``{"type": "function", "function": {...}}``)."""
    function = tool.get("function") if tool.get("type", "function") == "function" else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequest("each tool must be {'type': 'function', 'function': {'name': ...}}", "tools")
    parameters = function.get("parameters")
    if parameters is not None and not _an_object_schema(parameters):
        # As OpenAI and Anthropic refuse it: arguments are a JSON object, named values.
        raise InvalidRequest(
            f"tool {function['name']!r}: parameters must be a JSON schema of type 'object'", "tools"
        )
    return function


def _an_object_schema(schema: Any) -> bool:
    if not isinstance(schema, Mapping):
        return False
    kind = schema.get("type", "object")
    return kind == "object" and not any(k in schema for k in ("enum", "const"))


def check_unique_names(tools: Sequence[Mapping[str, Any]]) -> None:
    """Tools named alike cannot be told apart in the calls a model writes."""
    names = [function_of(t)["name"] for t in tools]
    if len(set(names)) < len(names):
        raise InvalidRequest("tools: tool names must be unique", "tools")


def call_parameters(function: Mapping[str, Any]) -> Mapping[str, Any]:
    """The schema a forced call's arguments follow: none, ``{}`` or ``{"type": "object", "properties": {}}``
    (what the Responses route writes for none) is no arguments."""
    parameters = function.get("parameters")
    if not parameters or (parameters.get("properties") == {} and set(parameters) <= {"type", "properties"}):
        return NO_ARGUMENTS
    return parameters


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
        f"call_{i}: {family.call_rule(f['name'], call_parameters(f), special or {})}"
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
