"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) over the engine
that serves the OpenAI routes.

A request becomes the same chat-template messages and tools an OpenAI chat request would (system first,
``tool_use`` blocks as assistant tool calls, ``tool_result`` blocks as tool messages), is submitted to the
engine like any other request, and its output comes back as content blocks. Streams follow Anthropic's
event sequence: ``message_start``, ``ping``, per block ``content_block_start`` / ``content_block_delta`` /
``content_block_stop``, then ``message_delta`` (stop reason, usage) and ``message_stop``. The streamed
and the whole answer are built by the same ``_Blocks`` from the same text, so they cannot disagree.

Usage follows Anthropic's accounting: ``input_tokens`` counts the prompt tokens computed for this request
and ``cache_read_input_tokens`` those the prefix cache supplied; their sum is the prompt's length.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_infer import tool_calls
from mlx_infer.constraints import ConstraintSpec
from mlx_infer.engine.request import RequestOutput
from mlx_infer.errors import InvalidRequest, MlxInferError, ModelNotFound
from mlx_infer.sampling import SamplingParams
from mlx_infer.server import chat_output
from mlx_infer.server.engine_call import LatencyClock, collect, submit
from mlx_infer.server.errors import (
    anthropic_error_body,
    describe,
)
from mlx_infer.server.null_defaults import NullMeansDefault
from mlx_infer.server.request_body import read_json
from mlx_infer.server.responses import new_id
from mlx_infer.server.schemas import INT32_MAX, stop_list
from mlx_infer.server.structured import json_schema_constraint

if TYPE_CHECKING:
    from mlx_infer.server.app import OpenAIServer
    from mlx_infer.tool_calls import ChatPlan, OutputParser

log = logging.getLogger("mlx_infer")


# ---- request schema ------------------------------------------------------------------------------
class _Lenient(NullMeansDefault):
    # Fields this server does not use (cache_control, citations, container, service_tier, ...) are
    # accepted and ignored, as the SDK sends them freely; NaN and infinities are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextBlock(_Lenient):
    type: Literal["text"]
    text: str


class ImageBlock(_Lenient):
    type: Literal["image", "document", "search_result"]


class ToolUseBlock(_Lenient):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(_Lenient):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[TextBlock | ImageBlock, Field(discriminator="type")]] | None = None
    is_error: bool = False

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "\n".join(_text_of(b, "tool_result content") for b in self.content)  # a line each


class ThinkingBlock(_Lenient):
    type: Literal["thinking"]
    thinking: str


class RedactedThinkingBlock(_Lenient):
    type: Literal["redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock,
    Field(discriminator="type"),
]


def _text_of(block: BaseModel, where: str) -> str:
    if not isinstance(block, TextBlock):
        raise InvalidRequest(f"{block.type} blocks are not supported in {where}: this server reads text only")
    return block.text


class Message(_Lenient):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(_Lenient):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,128}$")  # Anthropic's rule for a tool's name
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _client_tools_only(cls, value: Any) -> Any:
        # Anthropic's server tools (web search, code execution, ...) run on Anthropic's side: not here.
        kind = value.get("type") if isinstance(value, dict) else None
        if kind not in (None, "custom"):
            raise ValueError(f"tool type {kind!r} is not supported; only client tools with an input_schema")
        return value


class ToolChoice(_Lenient):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        if self.type == "tool" and not self.name:
            raise ValueError("tool_choice of type 'tool' needs a name")
        return self

    def as_openai(self) -> tool_calls.ToolChoice:
        """The same choice as the chat route's: any is required, tool a named function."""
        if self.type == "tool":
            return tool_calls.ToolChoice("required", self.name)
        return tool_calls.ToolChoice("required" if self.type == "any" else self.type)


class Thinking(_Lenient):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=0)


class _Conversation(_Lenient):
    """What both routes read: the conversation and what shapes its prompt."""

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class OutputFormat(_Lenient):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Lenient):
    format: OutputFormat | None = None  # (``effort`` is accepted and has nothing to set here)


class MessagesRequest(_Conversation):
    max_tokens: int = Field(ge=1, le=INT32_MAX)
    # The current SDK sends these three through extra_body; older ones as fields: the JSON is the same.
    temperature: float = Field(default=1.0, ge=0.0, le=1.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)
    stop_sequences: list[str] | None = None
    stop: Any = None  # the OpenAI name, which clients moving from it send: refused, not ignored
    stream: bool = False
    metadata: dict[str, Any] | None = None
    # Structured outputs: the answer is JSON valid against the schema (``output_format`` is the beta's).
    output_config: OutputConfig | None = None
    output_format: OutputFormat | None = None
    # Extensions (through extra_body), as the OpenAI routes take them.
    seed: int | None = None
    ignore_eos: bool = False
    speculative: bool = True  # false: this request never speculates (when the server does)

    @field_validator("stop_sequences")
    @classmethod
    def _stops(cls, value: list[str] | None) -> list[str] | None:
        stop_list(value)
        return value

    @field_validator("stop")
    @classmethod
    def _stop_is_chat_name(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("Anthropic's Messages API names it stop_sequences")

    def format_constraint(self) -> ConstraintSpec | None:
        """The JSON schema the answer follows (``output_config.format``, or the beta's ``output_format``)."""
        fmt = (self.output_config.format if self.output_config else None) or self.output_format
        if fmt is None:
            return None
        if self.messages[-1].role == "assistant":  # as Anthropic's: a prefill is no start of the JSON
            raise InvalidRequest("an assistant prefill cannot be continued as structured output", "messages")
        return json_schema_constraint("output_config.format.schema", fmt.schema_)

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=list(self.stop_sequences or []),
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
        )


# ---- request -> chat-template messages -----------------------------------------------------------
def chat_messages(body: _Conversation) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style chat messages for the template; a final assistant message is
    Anthropic's prefill, which the answer continues (``ChatPlan.continue_final_message``)."""
    messages: list[dict[str, Any]] = []
    if body.system:
        system = body.system if isinstance(body.system, str) else "\n".join(b.text for b in body.system)
        messages.append({"role": "system", "content": system})
    offered: set[str] = set()  # the tool_use ids of the assistant turn before
    for role, blocks, where in _turns(body.messages):
        if role == "user":
            for block in blocks:
                if isinstance(block, ToolResultBlock) and block.tool_use_id not in offered:
                    raise InvalidRequest(
                        f"{where}: unexpected tool_use_id {block.tool_use_id!r} in a tool_result block: each "
                        "tool_result answers a tool_use block of the assistant message before it"
                    )
            unanswered = offered - {b.tool_use_id for b in blocks if isinstance(b, ToolResultBlock)}
            if unanswered:
                raise InvalidRequest(
                    f"{where}: tool_use ids were found without tool_result blocks immediately after: "
                    f"{', '.join(sorted(unanswered))}; each tool_use block needs a tool_result block in the "
                    "next message"
                )
            messages.extend(_user_turn(blocks, where))
            offered = set()
        else:
            messages.append(_assistant_turn(blocks, where))
            offered = {b.id for b in blocks if isinstance(b, ToolUseBlock)}
    if not messages:
        raise InvalidRequest("messages: the conversation is empty")
    return messages


def _turns(messages: list[Message]) -> list[tuple[str, list, str]]:
    """(role, blocks, where) a turn: messages in a row from the same role are one turn, as Anthropic
    combines them (two assistant messages at the end are one prefill)."""
    turns: list[tuple[str, list, str]] = []
    for i, message in enumerate(messages):
        content = message.content
        blocks = [TextBlock(type="text", text=content)] if isinstance(content, str) else list(content)
        if turns and turns[-1][0] == message.role:
            turns[-1][1].extend(blocks)
        else:
            turns.append((message.role, blocks, f"messages.{i}.content"))
    return turns


def _user_turn(blocks: list, where: str) -> list[dict[str, Any]]:
    """Tool results become tool messages (in block order); text blocks in a row join one user message,
    a line each."""
    out: list[dict[str, Any]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            # The template has no flag for a failed call: the model reads it in the result.
            text = f"Error: {block.text()}" if block.is_error else block.text()
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": text})
        elif isinstance(block, ThinkingBlock | RedactedThinkingBlock | ToolUseBlock):
            raise InvalidRequest(f"{where}: {block.type} blocks belong to assistant messages")
        elif out and out[-1]["role"] == "user":
            out[-1]["content"] += "\n" + _text_of(block, where)
        else:
            out.append({"role": "user", "content": _text_of(block, where)})
    return out


def _assistant_turn(blocks: list, where: str) -> dict[str, Any]:
    turn: dict[str, Any] = {"role": "assistant", "content": ""}
    for block in blocks:
        if isinstance(block, ToolUseBlock):
            call = {"name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}
            turn.setdefault("tool_calls", []).append({"id": block.id, "type": "function", "function": call})
        elif isinstance(block, ThinkingBlock):
            turn["reasoning_content"] = turn.get("reasoning_content", "") + block.thinking
        elif isinstance(block, RedactedThinkingBlock):
            continue  # encrypted by Anthropic: nothing a local model can read
        elif isinstance(block, ToolResultBlock):
            raise InvalidRequest(f"{where}: tool_result blocks belong to user messages")
        else:
            turn["content"] += _text_of(block, where)
    return turn


def openai_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.input_schema,
            },
        }
        for t in tools
    ]


# ---- the answer as content blocks ----------------------------------------------------------------
def _event(name: str, data: dict[str, Any]) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


class _Blocks:
    """Content blocks as the answer's pieces arrive, and the stream events that announce them."""

    def __init__(self):
        self.content: list[dict[str, Any]] = []
        self._open: str | None = None  # the kind of the last block while it still grows
        self._json: list[str] = []  # argument fragments of an open tool_use block

    def _start(self, block: dict[str, Any], kind: str) -> list[str]:
        events = self.close()
        self.content.append(block)
        self._open = kind
        # Serialized now: the block as it starts (empty), before its deltas fill it in.
        body = {"type": "content_block_start", "index": len(self.content) - 1, "content_block": block}
        events.append(_event("content_block_start", body))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        body = {"type": "content_block_delta", "index": len(self.content) - 1, "delta": delta}
        return _event("content_block_delta", body)

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = [] if self._open == "text" else self._start({"type": "text", "text": ""}, "text")
        self.content[-1]["text"] += text
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        block = {"type": "thinking", "thinking": "", "signature": ""}
        events = [] if self._open == "thinking" else self._start(block, "thinking")
        self.content[-1]["thinking"] += text
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def call(self, call_id: str, name: str) -> list[str]:
        tool_use_id = "toolu_" + call_id.removeprefix("call_")  # Anthropic's id form
        return self._start({"type": "tool_use", "id": tool_use_id, "name": name, "input": {}}, "tool_use")

    def call_arguments(self, fragment: str) -> list[str]:
        self._json.append(fragment)
        return [self._delta({"type": "input_json_delta", "partial_json": fragment})]

    def close(self) -> list[str]:
        """Close the open block (a tool_use block gets its input from the arguments' JSON)."""
        if self._open is None:
            return []
        if self._open == "tool_use":
            arguments = "".join(self._json) or "{}"
            try:
                self.content[-1]["input"] = json.loads(arguments)
            except json.JSONDecodeError:
                self.content[-1]["input"] = {}
            self._json = []
        self._open = None
        return [_event("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def finish(self) -> list[str]:
        """Close the last block; an answer with no block at all gets one empty text block."""
        events = [] if self.content else self._start({"type": "text", "text": ""}, "text")
        return events + self.close()

    @property
    def has_tool_use(self) -> bool:
        return any(b["type"] == "tool_use" for b in self.content)


# ---- one call -------------------------------------------------------------------------------------
class _Call:
    """One /v1/messages call: its request's outputs, turned into blocks, a stop reason and usage."""

    def __init__(
        self,
        routes: AnthropicRoutes,
        body: MessagesRequest,
        prompt_ids: list[int],
        group,
        parser: OutputParser,
    ):
        self.server = routes.server
        self.body = body
        self.prompt_ids = prompt_ids
        self.group = group
        self.parser = parser  # the answer split into text, thinking and tool calls as it arrives
        self.id = new_id("msg").replace("-", "_")
        self.blocks = _Blocks()
        self.clock = LatencyClock(self.server.metrics, 1)
        self.output_ids: list[int] = []
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> list[str]:
        """Take one engine output; the stream events it makes."""
        self.clock.record(0, out)
        self.output_ids.extend(out.token_ids)
        self.last = out
        events = self.parser.feed(out.text) if out.text else []
        if out.finished:
            events += self.parser.finish()
        return chat_output.build(events, self.blocks)

    def usage(self) -> dict[str, int]:
        cached = self.last.num_cached_tokens if self.last else 0
        return {
            "input_tokens": len(self.prompt_ids) - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": self.last.num_output_tokens if self.last else 0,
        }

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished request."""
        # Cut off first: a call cut off is no call to run (its input is incomplete).
        if self.last is None or self.last.finish_reason == "length":
            # Short of max_tokens, the answer filled the context (raising max_tokens would not help).
            if self.last is not None and self.last.num_output_tokens < self.body.max_tokens:
                return "model_context_window_exceeded", None
            return "max_tokens", None
        if self.blocks.has_tool_use:
            return "tool_use", None
        tokenizer = self.server.tokenizer
        ended_by_eos = not self.output_ids or self.output_ids[-1] in tokenizer.eos_token_ids
        if ended_by_eos or not self.body.stop_sequences:
            return "end_turn", None
        # A stop string ended it: the earliest one in the full decoded output is the one the engine's
        # matcher found (it stops at the first complete match and never emits it).
        full = tokenizer.decode(self.output_ids)
        found = [(full.find(s), i) for i, s in enumerate(self.body.stop_sequences) if s in full]
        return "stop_sequence", self.body.stop_sequences[min(found)[1]] if found else None

    def message(self, content: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop() if content is None else (None, None)
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.body.model,
            "content": self.blocks.content if content is None else content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": self.usage(),
        }

    async def stream(self) -> AsyncIterator[str]:
        started = False
        try:
            async for _, out in self.group:
                events = self.add(out)
                if not started:
                    # Sent once the first output is in, so its usage already has the cached-token count.
                    started = True
                    yield _event("message_start", {"type": "message_start", "message": self.message([])})
                    yield _event("ping", {"type": "ping"})
                for event in events:
                    yield event
            for event in self.blocks.finish():
                yield event
            stop_reason, stop_sequence = self.stop()
            delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
            yield _event("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage()})
            yield _event("message_stop", {"type": "message_stop"})
        except Exception as e:  # noqa: BLE001 - the 200 header is sent: report any failure in the stream
            if not isinstance(e, MlxInferError):
                log.exception("request failed")
            status, message, _, _ = describe(e)
            yield _event("error", anthropic_error_body(529 if status == 429 else status, message))
        finally:
            self.group.close()


# ---- routes ---------------------------------------------------------------------------------------
class AnthropicRoutes:
    def __init__(self, server: OpenAIServer):
        self.server = server

    def routes(self) -> list[Route]:
        return [
            Route("/v1/messages", self.server.guarded(self.messages, anthropic=True), methods=["POST"]),
            Route(
                "/v1/messages/count_tokens",
                self.server.guarded(self.count_tokens, anthropic=True),
                methods=["POST"],
            ),
        ]

    async def _body(self, request: Request, schema):
        body = await read_json(request, schema, self.server.config.max_request_bytes)
        if body.model != self.server.config.model_name:
            raise ModelNotFound(
                f"model: {body.model!r} does not exist; this server has {self.server.config.model_name!r}"
            )
        return body

    async def _prompt(self, body: _Conversation) -> tuple[ChatPlan, list[int]]:
        """The request's plan (tools as the chat route writes them into the prompt, the call tool_choice
        forces) and its prompt ids."""
        messages = chat_messages(body)
        kwargs: dict[str, Any] = {}
        if body.thinking is not None and body.thinking.type != "adaptive":
            kwargs["enable_thinking"] = body.thinking.type == "enabled"
        choice = body.tool_choice or ToolChoice(type="auto")
        plan = self.server.plan_chat(
            openai_tools(body.tools), choice.as_openai(), not choice.disable_parallel_tool_use, kwargs
        )
        plan = dataclasses.replace(plan, continue_final_message=messages[-1]["role"] == "assistant")
        # Templating and tokenizing a long prompt takes a while: off the loop that feeds every stream.
        return plan, await run_in_threadpool(plan.render, messages)

    async def count_tokens(self, request: Request) -> Response:
        body = await self._body(request, _Conversation)
        _, ids = await self._prompt(body)
        return JSONResponse({"input_tokens": len(ids)})

    async def messages(self, request: Request) -> Response:
        body: MessagesRequest = await self._body(request, MessagesRequest)
        plan, prompt_ids = await self._prompt(body)
        [params] = await self.server.constrain(
            [body.sampling_params()], plan, body.format_constraint(), "output_config.format"
        )
        parser = plan.parser(prompt_ids)
        group = submit(self.server.engine, [(prompt_ids, params)], "messages")
        call = _Call(self, body, prompt_ids, group, parser)
        if body.stream:
            return StreamingResponse(
                call.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        if not await collect(group, request, lambda _, out: call.add(out)):
            return Response(status_code=499)
        call.blocks.finish()
        return JSONResponse(call.message())
