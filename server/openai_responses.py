"""OpenAI's Responses API (``POST /v1/responses``), the stateless part, over the engine that serves the
other routes.

``input`` (a string or items: messages, ``function_call``, ``function_call_output``, ``reasoning``) and
``instructions`` become the chat-template messages an OpenAI chat request would, and the output comes
back as output items (``message`` with ``output_text``, ``function_call``, ``reasoning``). Streams send
the typed events of the API, each with its ``sequence_number``: ``response.created``,
``response.in_progress``, per item ``response.output_item.added`` / ``...done`` with the content part and
text or argument deltas between, then ``response.completed`` (``response.incomplete`` when
``max_output_tokens`` cut it). The streamed and the whole answer come from the same ``_Items``.

Nothing is stored: ``store: true`` and ``previous_response_id`` are refused with a 400 that says to send
the whole conversation as ``input`` (the prefix cache makes resending it cheap).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    ValidationInfo,
    field_validator,
    model_validator,
)
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_infer.constraints import ConstraintSpec
from mlx_infer.context_policy import fit_for_engine, request_policy
from mlx_infer.engine.request import RequestOutput
from mlx_infer.errors import InvalidRequest, MlxInferError
from mlx_infer.sampling import SamplingParams
from mlx_infer.server import chat_output
from mlx_infer.server.engine_call import LatencyClock, collect, default_max_tokens, submit
from mlx_infer.server.errors import describe
from mlx_infer.server.null_defaults import NullMeansDefault
from mlx_infer.server.responses import new_id, now
from mlx_infer.server.schemas import INT32_MAX, stop_list
from mlx_infer.server.structured import SCHEMA_NAME_PATTERN, text_format_constraint
from mlx_infer.tool_calls import ToolChoice

if TYPE_CHECKING:
    from mlx_infer.server.app import OpenAIServer
    from mlx_infer.tool_calls import OutputParser

log = logging.getLogger("mlx_infer")


# ---- request schema ------------------------------------------------------------------------------
class _Lenient(NullMeansDefault):
    # Fields this server does not use (include, truncation, user, service_tier, ...) are accepted and
    # ignored; NaN and infinities are refused.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)


class TextPart(_Lenient):
    type: Literal["input_text", "output_text", "text", "refusal"]
    text: str = ""
    refusal: str = ""


class OtherPart(_Lenient):
    type: Literal["input_image", "input_file", "input_audio"]


Part = Annotated[TextPart | OtherPart, Field(discriminator="type")]


def _part_text(part: TextPart | OtherPart, where: str) -> str:
    if isinstance(part, OtherPart):
        raise InvalidRequest(
            f"{where}: {part.type} parts are not supported: this server reads text only", param=where
        )
    return part.refusal if part.type == "refusal" else part.text


class MessageItem(_Lenient):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[Part]

    def text(self, where: str) -> str:
        if isinstance(self.content, str):
            return self.content
        # A line each, as the chat route joins text parts; an assistant's are pieces of one answer.
        return ("" if self.role == "assistant" else "\n").join(_part_text(p, where) for p in self.content)


class FunctionCallItem(_Lenient):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_Lenient):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[Part]


class ReasoningContent(_Lenient):
    text: str = ""


class ReasoningItem(_Lenient):
    type: Literal["reasoning"]
    summary: list[ReasoningContent] = []
    content: list[ReasoningContent] | None = None


def _item_kind(value: Any) -> str:
    # A message may leave out its type (the SDK's EasyInputMessage); every other item names it.
    kind = value.get("type", "message") if isinstance(value, dict) else getattr(value, "type", None)
    return kind if isinstance(kind, str) else ""


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="invalid_item",
        custom_error_message="an input item is a message, function_call, function_call_output or reasoning "
        "item (item references and hosted tools' items need stored state or tools this server lacks)",
    ),
]


class FunctionTool(_Lenient):
    type: Literal["function"]
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunction(_Lenient):
    type: Literal["function"]
    name: str

    @model_validator(mode="before")
    @classmethod
    def _chat_form_too(cls, value: Any) -> Any:
        # The chat route's form ({"type": "function", "function": {"name": ...}}), which clients moving
        # from chat completions send: the same choice.
        if isinstance(value, dict) and "name" not in value and isinstance(value.get("function"), dict):
            return {**value, "name": value["function"].get("name")}
        return value


class TextFormat(_Lenient):
    type: Literal["text", "json_schema", "json_object"]
    name: str | None = Field(default=None, pattern=SCHEMA_NAME_PATTERN)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> TextFormat:
        if self.type == "json_schema" and self.name is None:
            raise ValueError("a json_schema format needs a name")
        return self


class TextConfig(_Lenient):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # echoed: a hint for models trained on it


class Reasoning(_Lenient):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"
_NOT_RESPONSES_FIELDS = {
    "max_tokens": "the Responses API's is max_output_tokens",
    "max_completion_tokens": "the Responses API's is max_output_tokens",
    "messages": "the Responses API's is input",
    "response_format": "the Responses API's is text.format",
    "n": "the Responses API gives one answer a request",
}


class ResponsesRequest(_Lenient):
    model: str | None = None  # the served model when left out (a server of one model)
    input: str | list[Item] | None = None  # (optional only to say why a stored prompt is refused)
    instructions: str | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedFunction = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    conversation: str | dict[str, Any] | None = None  # (stored conversations and prompts: refused)
    prompt: dict[str, Any] | None = None
    background: bool = False
    metadata: dict[str, str] | None = None
    # "auto": a conversation longer than the context loses its oldest turns (the chat route's
    # truncate-oldest); "disabled": the server's --context-overflow (by default a 400).
    truncation: Literal["auto", "disabled"] = "disabled"
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    reasoning: Reasoning | None = None  # echoed (thinking is the template's: chat_template_kwargs)
    # Echoed as OpenAI echoes them; nothing here depends on them.
    user: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    # Extensions (through extra_body), as the chat route takes them.
    top_k: int = Field(default=0, ge=0, le=INT32_MAX)
    seed: int | None = None
    stop: str | list[str] | None = None  # not OpenAI's Responses API, which has no stop strings
    ignore_eos: bool = False
    speculative: bool = True  # false: this request never speculates (when the server does)
    # The chat API's names, which clients moving from it send: refused (as OpenAI refuses them) where
    # ignoring them would change the answer (an ignored max_tokens runs it to the end of the context).
    max_tokens: Any = None
    max_completion_tokens: Any = None
    messages: Any = None
    response_format: Any = None
    n: Any = None

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stop_list(value)
        return value

    @field_validator("max_tokens", "max_completion_tokens", "messages", "response_format", "n")
    @classmethod
    def _chat_names(cls, value: Any, info: ValidationInfo) -> None:
        if value is not None:
            raise ValueError(_NOT_RESPONSES_FIELDS[info.field_name])

    def openai_tool_choice(self) -> ToolChoice:
        if isinstance(self.tool_choice, str):
            return ToolChoice(self.tool_choice)
        return ToolChoice("required", self.tool_choice.name)

    def format_constraint(self) -> ConstraintSpec | None:
        """``text.format`` as the constraint the answer follows (json_schema, json_object), or None."""
        fmt = self.text.format if self.text else None
        return None if fmt is None else text_format_constraint(fmt.type, fmt.schema_)

    def logprobs_count(self) -> int | None:
        """Top alternatives a token's log-probability comes with, or None: not asked (as OpenAI's, only
        ``include`` asks; ``top_logprobs`` says how many alternatives)."""
        return (self.top_logprobs or 0) if LOGPROBS_INCLUDE in (self.include or []) else None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop_list(self.stop),
            ignore_eos=self.ignore_eos,
            speculative=self.speculative,
            logprobs=self.logprobs_count(),
        )


# ---- request -> chat-template messages -----------------------------------------------------------
def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """``instructions`` and ``input`` as OpenAI-style chat messages: function calls join the assistant
    turn before them, their outputs become tool messages."""
    messages: list[dict[str, Any]] = []
    if body.instructions:
        messages.append({"role": "system", "content": body.instructions})
    items = [MessageItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input
    called: list[str] = []  # the call_ids of the function calls so far, which outputs answer
    for i, item in enumerate(items):
        where = f"input.{i}"
        if isinstance(item, MessageItem):
            # Templates know system, user and assistant; the developer role is the system's here.
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": item.text(where)})
        elif isinstance(item, FunctionCallOutputItem):
            if item.call_id not in called:
                raise InvalidRequest(
                    f"{where}: no function_call found for the function_call_output with call_id "
                    f"{item.call_id!r}",
                    param=where,
                )
            output = (
                item.output
                if isinstance(item.output, str)
                else "\n".join(_part_text(p, where) for p in item.output)  # a line each
            )
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            turn = _assistant_turn(messages)
            if isinstance(item, FunctionCallItem):
                called.append(item.call_id)
                call = {"name": item.name, "arguments": item.arguments}
                turn.setdefault("tool_calls", []).append(
                    {"id": item.call_id, "type": "function", "function": call}
                )
            else:
                texts = item.content if item.content is not None else item.summary
                turn["reasoning_content"] = turn.get("reasoning_content", "") + "".join(t.text for t in texts)
    if not messages:
        raise InvalidRequest("input: the conversation is empty", param="input")
    answered = {m["tool_call_id"] for m in messages if m["role"] == "tool"}
    unanswered = [c for c in called if c not in answered]
    if unanswered:  # as OpenAI's: a call the model made is answered before the conversation goes on
        raise InvalidRequest(f"input: no tool output found for function call {unanswered[0]}", param="input")
    return messages


def _assistant_turn(messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The assistant message a function call or reasoning item belongs to: the last one, unless a
    user or tool message came after it."""
    if not messages or messages[-1]["role"] != "assistant":
        messages.append({"role": "assistant", "content": ""})
    return messages[-1]


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    if not body.tools or body.tool_choice == "none":
        return None
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                **({"description": t.description} if t.description is not None else {}),
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in body.tools
    ]


# ---- the answer as output items ------------------------------------------------------------------
class _Items:
    """Output items as the answer's pieces arrive, and the typed stream events that announce them."""

    def __init__(self):
        self.output: list[dict[str, Any]] = []
        self._open: str | None = None  # the type of the last item while it still grows
        self.sequence = 0
        # The log-probabilities of the tokens whose text has not arrived yet (a stop string's possible
        # start is held back), when asked for: they ride on the next text delta. Tokens that became
        # reasoning or a call have none (output_text's only).
        self.logprobs: list[dict[str, Any]] = []

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _item_event(self, kind: str) -> str:
        return self.event(kind, output_index=len(self.output) - 1, item=self.output[-1])

    def _part_event(self, kind: str, **fields: Any) -> str:
        item = self.output[-1]
        return self.event(
            kind, item_id=item["id"], output_index=len(self.output) - 1, content_index=0, **fields
        )

    def _start(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.output.append({**item, "status": "in_progress"} if item["type"] != "reasoning" else item)
        self._open = item["type"]
        return [*events, self._item_event("response.output_item.added")]

    def text(self, text: str) -> list[str]:
        if not text:
            return []
        events = []
        if self._open != "message":
            item = {
                "type": "message",
                "id": new_id("msg").replace("-", "_"),
                "role": "assistant",
                "content": [],
            }
            events = self._start(item)
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            events.append(self._part_event("response.content_part.added", part=part))
            self.output[-1]["content"].append(part)
        part = self.output[-1]["content"][0]
        part["text"] += text
        logprobs, self.logprobs = self.logprobs, []
        part["logprobs"] += logprobs
        return [*events, self._part_event("response.output_text.delta", delta=text, logprobs=logprobs)]

    def reasoning(self, text: str) -> list[str]:
        if not text:
            return []
        self.logprobs = []
        events = []
        if self._open != "reasoning":
            item = {"type": "reasoning", "id": new_id("rs").replace("-", "_"), "summary": [], "content": []}
            events = self._start(item)
            part = {"type": "reasoning_text", "text": ""}
            events.append(self._part_event("response.content_part.added", part=part))
            self.output[-1]["content"].append(part)
        self.output[-1]["content"][0]["text"] += text
        return [*events, self._part_event("response.reasoning_text.delta", delta=text)]

    def call(self, call_id: str, name: str) -> list[str]:
        self.logprobs = []
        item_id = new_id("fc").replace("-", "_")
        return self._start(
            {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": ""}
        )

    def call_arguments(self, fragment: str) -> list[str]:
        self.logprobs = []
        self.output[-1]["arguments"] += fragment
        item = self.output[-1]
        return [
            self.event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=len(self.output) - 1,
                delta=fragment,
            )
        ]

    def close(self, status: str = "completed") -> list[str]:
        """Close the open item; ``status`` is the item's when it is a message or a call ("incomplete"
        when max_output_tokens cut the answer off, as OpenAI marks it)."""
        kind, self._open = self._open, None
        if kind is None:
            return []
        item = self.output[-1]
        events = []
        if kind == "message":
            part = item["content"][0]
            done = self._part_event("response.output_text.done", text=part["text"], logprobs=part["logprobs"])
            events.append(done)
            events.append(self._part_event("response.content_part.done", part=part))
        elif kind == "reasoning":
            part = item["content"][0]
            events.append(self._part_event("response.reasoning_text.done", text=part["text"]))
            events.append(self._part_event("response.content_part.done", part=part))
        else:
            events.append(
                self.event(
                    "response.function_call_arguments.done",
                    item_id=item["id"],
                    output_index=len(self.output) - 1,
                    name=item["name"],
                    arguments=item["arguments"],
                )
            )
        if kind != "reasoning":
            item["status"] = status
        return [*events, self._item_event("response.output_item.done")]


# ---- one call -------------------------------------------------------------------------------------
class _Call:
    """One /v1/responses call: its request's outputs, turned into output items, a status and usage."""

    def __init__(
        self, server: OpenAIServer, body: ResponsesRequest, prompt_ids: list[int], group, parser: OutputParser
    ):
        self.server = server
        self.body = body
        self.prompt_ids = prompt_ids
        self.group = group
        self.parser = parser  # the answer split into text, reasoning and function calls as it arrives
        self.id = new_id("resp").replace("-", "_")
        self.created = now()
        self.items = _Items()
        self.clock = LatencyClock(server.metrics, 1)
        self.last: RequestOutput | None = None

    def add(self, out: RequestOutput) -> list[str]:
        self.clock.record(0, out)
        self.last = out
        if out.logprobs:
            self.items.logprobs += self.server.logprobs.chat(out.logprobs)["content"]
        events = self.parser.feed(out.text) if out.text else []
        if out.finished:
            events += self.parser.finish()
        return chat_output.build(events, self.items)

    def item_status(self) -> str:
        """The status of the item the answer ends in."""
        cut = self.last is not None and self.last.finish_reason == "length"
        return "incomplete" if cut else "completed"

    def response(self, final: bool) -> dict[str, Any]:
        body = self.body
        status, usage, incomplete = "in_progress", None, None
        if final:
            status = "completed"
            if self.last is not None and self.last.finish_reason == "length":
                status, incomplete = "incomplete", {"reason": "max_output_tokens"}
            cached = self.last.num_cached_tokens if self.last else 0
            output_tokens = self.last.num_output_tokens if self.last else 0
            usage = {
                "input_tokens": len(self.prompt_ids),
                "input_tokens_details": {"cached_tokens": cached},
                "output_tokens": output_tokens,
                "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": len(self.prompt_ids) + output_tokens,
            }
        text_format = body.text.format if body.text and body.text.format else None
        reasoning = body.reasoning or Reasoning()
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "completed_at": now() if final and status == "completed" else None,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "model": body.model,
            "output": self.items.output if final else [],
            "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": None,
            "reasoning": {"effort": reasoning.effort, "summary": reasoning.summary},
            "store": False,
            "temperature": body.temperature,
            "text": {
                "format": text_format.model_dump(by_alias=True, exclude_none=True)
                if text_format
                else {"type": "text"},
                "verbosity": (body.text and body.text.verbosity) or "medium",
            },
            "tool_choice": body.tool_choice
            if isinstance(body.tool_choice, str)
            else body.tool_choice.model_dump(),
            "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
            "top_p": body.top_p,
            "top_logprobs": body.top_logprobs or 0,
            "truncation": body.truncation,
            "usage": usage,
            "metadata": body.metadata or {},
            "user": body.user,
            "prompt_cache_key": body.prompt_cache_key,
            "safety_identifier": body.safety_identifier,
            "service_tier": body.service_tier if body.service_tier not in (None, "auto") else "default",
        }

    async def stream(self) -> AsyncIterator[str]:
        items = self.items
        try:
            yield items.event("response.created", response=self.response(final=False))
            yield items.event("response.in_progress", response=self.response(final=False))
            async for _, out in self.group:
                for event in self.add(out):
                    yield event
            for event in items.close(self.item_status()):
                yield event
            final = self.response(final=True)
            yield items.event(f"response.{final['status']}", response=final)
        except Exception as e:  # noqa: BLE001 - the 200 header is sent: report any failure in the stream
            if not isinstance(e, MlxInferError):
                log.exception("request failed")
            _, message, type_, param = describe(e)
            yield items.event("error", code=type_, message=message, param=param)
        finally:
            self.group.close()


# ---- route ----------------------------------------------------------------------------------------
class ResponsesRoute:
    def __init__(self, server: OpenAIServer):
        self.server = server

    def routes(self) -> list[Route]:
        return [Route("/v1/responses", self.server.guarded(self.create), methods=["POST"])]

    async def create(self, request: Request) -> Response:
        body: ResponsesRequest = await self.server._body(request, ResponsesRequest)
        if body.prompt:
            raise InvalidRequest(
                "prompt: this server keeps no prompt templates; send the instructions and input themselves",
                param="prompt",
            )
        if body.input is None:
            raise InvalidRequest("input: Field required", param="input")
        stateful = ("previous_response_id", "conversation", "store", "background")
        field = next((f for f in stateful if getattr(body, f)), None)
        if field is not None:
            raise InvalidRequest(
                f"{field}: this server keeps no responses; send store=false and the whole conversation "
                "as input (the prefix cache makes resending it cheap)",
                param=field,
            )
        messages = chat_messages(body)
        plan = self.server.plan_chat(chat_tools(body), body.openai_tool_choice(), body.parallel_tool_calls)
        engine = self.server.engine.engine
        overflow = "truncate-oldest" if body.truncation == "auto" else None
        policy, _ = request_policy(self.server.config.context_overflow, overflow, None)
        # Templating and tokenizing a long prompt takes a while: off the loop that feeds every stream.
        fitted = await run_in_threadpool(
            fit_for_engine, messages, plan.render, engine, body.max_output_tokens, policy
        )
        prompt_ids = fitted.prompt_ids
        max_tokens = body.max_output_tokens or default_max_tokens(engine, len(prompt_ids))
        [params] = await self.server.constrain(
            [body.sampling_params(max_tokens)], plan, body.format_constraint(), "text.format"
        )
        parser = plan.parser(prompt_ids)
        group = submit(self.server.engine, [(prompt_ids, params)], "input")
        call = _Call(self.server, body, prompt_ids, group, parser)
        if body.stream:
            return StreamingResponse(
                call.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        if not await collect(group, request, lambda _, out: call.add(out)):
            return Response(status_code=499)
        call.items.close(call.item_status())
        return JSONResponse(call.response(final=True))
