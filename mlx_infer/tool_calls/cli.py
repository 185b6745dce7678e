"""The tool-call and reasoning flags: the parsers a model gets (``generate`` and ``serve``) and the tools a
``generate`` chat offers the model (``--tools FILE``, ``--tool-choice``)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from mlx_infer import reasoning
from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.prompt import ChatPlan, ToolChoice, prepare_chat
from mlx_infer.tool_calls.registry import ALIASES, CHOICES, FAMILIES, model_parsers


def add_parser_arguments(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    parser.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=CHOICES,
        metavar="NAME",
        help="how the model writes tool calls: " + ", ".join(FAMILIES) + " (aliases: "
        + ", ".join(f"{a}={f}" for a, f in ALIASES.items()) + "); 'none' parses "
        "none (default: auto, from the chat template and tokenizer)",
    )
    parser.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=reasoning.CHOICES,
        metavar="NAME",
        help="split <think>...</think> reasoning from the answer: think (alias qwen3, deepseek_r1) "
        "or none (default: auto, on when the chat template or vocabulary has <think>)",
    )


def add_tool_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("tools and reasoning")
    g.add_argument(
        "--tools",
        type=Path,
        default=None,
        metavar="FILE",
        help="JSON list of tools in OpenAI's shape ({'type': 'function', 'function': {'name', "
        "'description', 'parameters'}}) the model may call; calls are shown, not run",
    )
    g.add_argument(
        "--tool-choice",
        default="auto",
        metavar="auto|none|required|NAME",
        help="auto (the model decides), none, required (a call is forced by a grammar) or a function "
        "name to force (default: auto)",
    )
    add_parser_arguments(g)


def chat_plan(args: argparse.Namespace, tokenizer: Any) -> ChatPlan:
    """The prompt rendering and answer parsing the flags ask for, checked before the chat starts."""
    tools = read_tools(args.tools) if args.tools is not None else []
    choice = args.tool_choice
    tool_choice = ToolChoice.parse(choice if choice in ("auto", "none", "required") else _named(choice))
    family, reasoning_name = model_parsers(tokenizer, args.tool_call_parser, args.reasoning_parser)
    return prepare_chat(
        tokenizer,
        family=family,
        reasoning=reasoning_name,
        tools=tools,
        tool_choice=tool_choice,
        parallel=True,
    )


def _named(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name}}


def read_tools(path: Path) -> list[dict[str, Any]]:
    """The --tools file's list; a file that cannot be read or is no JSON list is an InvalidRequest."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise InvalidRequest(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:
        raise InvalidRequest(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, list) or not all(isinstance(t, dict) for t in data):
        raise InvalidRequest(f"{path}: expected a JSON list of {{'type': 'function', 'function': {{...}}}}")
    return data  # each tool is checked by prepare_chat
