"""A chat request with tools, made ready for the engine: the prompt (tools and past calls written in for
templates that cannot render them), the grammar forcing a call when the request demands one, and the
output parser for its answer. Shared by every API surface."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlx_infer.chat_template import select_template
from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls.base import ToolFamily
from mlx_infer.tool_calls.forcing import check_unique_names, forced_call_constraint, function_of
from mlx_infer.tool_calls.output import OutputParser
from mlx_infer.tool_calls.think import starts_in_reasoning

_PROMPT_TAIL_TOKENS = 8  # enough of the prompt's end to see an opened <think>


@dataclass(frozen=True)
class ToolChoice:
    """``tool_choice`` normalized: ``mode`` is auto, none or required; ``name`` a forced function."""

    mode: str = "auto"
    name: str | None = None

    @classmethod
    def parse(cls, value: Any) -> ToolChoice:
        """OpenAI's forms: "auto" | "none" | "required" | {"type": "function", "function": {"name": ...}}."""
        if value is None:
            return cls()
        if isinstance(value, str):
            if value not in ("auto", "none", "required"):
                raise InvalidRequest(
                    f"tool_choice must be auto, none, required or a function, not {value!r}", "tool_choice"
                )
            return cls(value)
        if isinstance(value, Mapping):
            function = value.get("function")
            name = function.get("name") if isinstance(function, Mapping) else value.get("name")
            if isinstance(name, str) and name:
                return cls("required", name)
        raise InvalidRequest(
            "tool_choice must be auto, none, required or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )


@dataclass
class ChatPlan:
    """How one chat request's prompt is rendered and its answer parsed (from ``prepare_chat``)."""

    tokenizer: Any
    family: ToolFamily | None  # the model's family; None: answers are not parsed for calls
    tools: list[Mapping[str, Any]]  # the tools the template sees (none for tool_choice "none")
    reasoning: str | None
    parallel: bool
    constraint: Any  # a ConstraintSpec forcing a call (tool_choice required / named), or None
    template_kwargs: dict[str, Any]
    # vLLM's: open the assistant's turn after the messages; or (continue_final_message; Anthropic's
    # prefill) leave a final assistant message open, for the answer to go on from its last character.
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def render_text(self, messages: Sequence[Mapping[str, Any]]) -> str:
        messages = [dict(m) for m in messages]
        if self.family is not None:
            template = select_template(self.tokenizer.chat_template, self.tools or None)
            messages = written_for_template(self.family, template, messages, self.tools)
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self.tools or None,
            add_generation_prompt=self.add_generation_prompt or self.continue_final_message,
            **self.template_kwargs,
        )

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids of ``messages`` (the template writes any BOS itself). With continue_final_message
        the turns before the final assistant message are rendered with the assistant's turn opened, and
        that message's text follows."""
        prefill = ""
        if self.continue_final_message:
            messages, prefill = split_prefill(messages)
        ids = self.tokenizer.encode(self.render_text(messages), add_special_tokens=False)
        return ids + self.tokenizer.encode(prefill, add_special_tokens=False) if prefill else ids

    def parser(self, prompt_ids: Sequence[int] = ()) -> OutputParser:
        """A fresh parser for one choice's output; ``prompt_ids`` tell whether the answer starts inside
        a reasoning block the template opened."""
        # A forced call starts at once (the grammar admits no reasoning first), whatever the prompt opened.
        in_reasoning = (
            self.reasoning is not None
            and self.constraint is None
            and starts_in_reasoning(self.tokenizer.decode(list(prompt_ids[-_PROMPT_TAIL_TOKENS:])))
        )
        family = self.family if self.tools else None
        functions = [function_of(t) for t in self.tools]
        names = [f["name"] for f in functions]
        parameters = {f["name"]: f.get("parameters") or {} for f in functions}
        forced = self.constraint is not None
        return OutputParser(family, names, self.reasoning, in_reasoning, self.parallel, parameters, forced)


def split_prefill(messages: Sequence[Mapping[str, Any]]) -> tuple[list[Mapping[str, Any]], str]:
    """The turns before a final assistant message, and its text: the prefill the answer continues."""
    if not messages or messages[-1].get("role") != "assistant":
        raise InvalidRequest(
            "the last message must be the assistant's, for the answer to continue it", "messages"
        )
    if messages[-1].get("tool_calls"):
        raise InvalidRequest("the last message cannot end with tool calls: send their results", "messages")
    if len(messages) == 1:
        raise InvalidRequest("the conversation needs a user message before the assistant's", "messages")
    return list(messages[:-1]), messages[-1].get("content") or ""


def prepare_chat(
    tokenizer: Any,
    *,
    family: ToolFamily | None,
    reasoning: str | None,
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: ToolChoice = ToolChoice(),
    parallel: bool = True,
    template_kwargs: Mapping[str, Any] | None = None,
) -> ChatPlan:
    """Check a chat request's tool fields and plan its prompt and parsing. ``family`` / ``reasoning``:
    the model's parsers (``resolve``; None: off). Bad tools or tool_choice raise ``InvalidRequest``."""
    tools = list(tools or [])
    check_unique_names(tools)  # (every tool checked on the way)
    if tool_choice.mode == "required" and not tools:
        raise InvalidRequest("tool_choice forces a tool call, which needs tools", "tool_choice")
    if tool_choice.mode == "required" and family is None:
        raise InvalidRequest("this server parses no tool calls (--tool-call-parser none)", "tool_choice")
    active = tools if tool_choice.mode != "none" else []
    constraint = None
    if tool_choice.mode == "required" and family is not None:
        special = special_marker_ids(tokenizer, family)
        constraint = forced_call_constraint(family, active, tool_choice.name, parallel, special)
    return ChatPlan(
        tokenizer=tokenizer,
        family=family,
        tools=active,
        reasoning=reasoning,
        parallel=parallel and tool_choice.name is None,
        constraint=constraint,
        template_kwargs=dict(template_kwargs or {}),
    )


def written_for_template(
    family: ToolFamily, template: str, messages: list[dict[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """What a template that knows nothing of tools needs in its messages: the tools in the system
    prompt, past calls in the assistant's text, tool results as user turns. Templates that render
    tools, calls or the tool role themselves get those untouched."""
    out: list[dict[str, Any]] = []
    for m in messages:
        if m.get("role") == "assistant" and m.get("tool_calls") and "tool_calls" not in template:
            calls = [_name_and_arguments(c) for c in m["tool_calls"]]
            text = m.get("content") or ""
            m = {k: v for k, v in m.items() if k != "tool_calls"}
            m["content"] = (text + "\n" if text else "") + family.render_calls(calls)
        elif m.get("role") == "tool" and "tool" not in template.replace("tool_calls", ""):
            result = f"<tool_response>\n{m.get('content') or ''}\n</tool_response>"
            if out and out[-1].get("role") == "user" and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + result}
                continue
            m = {"role": "user", "content": result, "tool_results": True}
        out.append(m)
    out = [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
    if tools and "tools" not in template:
        section = family.tools_prompt(tools)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{section}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def _name_and_arguments(call: Mapping[str, Any]) -> tuple[str, Any]:
    function = call.get("function") if isinstance(call.get("function"), Mapping) else call
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return str(function.get("name", "")), arguments


def special_marker_ids(tokenizer: Any, family: ToolFamily) -> dict[str, int]:
    """The family's markers that this tokenizer has as single special tokens (a grammar names them by id)."""
    markers = (*family.starts, *((family.end,) if family.end else ()), *family.markers, "</tool_call>")
    special = {}
    try:
        added = tokenizer.backend.get_added_tokens_decoder()
    except AttributeError:
        return special
    by_text = {t.content: i for i, t in added.items() if getattr(t, "special", False)}
    for marker in markers:
        if marker in by_text:
            special[marker] = by_text[marker]
    return special
