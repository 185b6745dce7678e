"""The starlette application: OpenAI-compatible routes over an AsyncEngine. No model code here."""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mlx_infer.constraints import ConstraintSpec, compile_constraint
from mlx_infer.context_policy import fit_for_engine, request_policy
from mlx_infer.engine.async_engine import AsyncEngine, RequestGroup
from mlx_infer.engine.request import RequestOutput
from mlx_infer.errors import InvalidRequest, MlxInferError, ModelNotFound
from mlx_infer.reasoning import template_kwargs
from mlx_infer.sampling import SamplingParams
from mlx_infer.server import chat_output
from mlx_infer.server.anthropic import AnthropicRoutes
from mlx_infer.server.embeddings import EmbeddingRoutes
from mlx_infer.server.engine_call import LatencyClock, collect, default_max_tokens, submit
from mlx_infer.server.errors import (
    anthropic_error_response,
    anthropic_shaped,
    error_response,
    for_exception,
    from_exception,
    unauthorized,
)
from mlx_infer.server.metrics import Metrics
from mlx_infer.server.openai_responses import ResponsesRoute
from mlx_infer.server.request_body import DEFAULT_MAX_REQUEST_BYTES, read_json
from mlx_infer.server.responses import Choice, LogprobFormatter, new_id, now, usage
from mlx_infer.server.schemas import ChatCompletionRequest, CompletionRequest
from mlx_infer.server.web import routes as web_routes
from mlx_infer.tool_calls import ChatPlan, Event, ToolChoice, model_parsers, prepare_chat
from mlx_infer.tool_calls.forcing import call_parameters, function_of

log = logging.getLogger("mlx_infer")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    web: bool = True  # the chat page at / (server/web.py)
    model_details: dict[str, str] = field(default_factory=dict)  # architecture, quantization
    context_overflow: str = "error"  # the default of requests that name no context_policy
    tool_call_parser: str = "auto"  # mlx_infer.tool_calls family name, "auto" or "none"
    reasoning_parser: str = "auto"  # mlx_infer.reasoning parser name, "auto" or "none"


def authorized(request: Request, api_key: str | None) -> bool:
    """Whether the request carries the API key (when one is set): ``Authorization: Bearer KEY`` or
    Anthropic's ``x-api-key: KEY``."""
    if api_key is None:
        return True
    key = api_key.encode()
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    bearer = credentials.encode() if scheme.lower() == "bearer" else b""  # a scheme is any case (RFC 9110)
    # Constant-time comparisons, both made: the time a mismatch takes must not reveal the key's prefix.
    api_key_header = request.headers.get("x-api-key", "").encode()
    return hmac.compare_digest(bearer, key) | hmac.compare_digest(api_key_header, key)


def from_anthropic_client(request: Request) -> bool:
    """Whether ``request`` is answered in Anthropic's shapes: on /v1/messages, and on the routes both
    clients use when Anthropic's client sent it (every one sends ``anthropic-version``)."""
    return anthropic_shaped(request.url.path, request.headers)


# A step (a prefill chunk, a decode step) takes well under a second to seconds: one running this long
# will not end by itself.
STALLED_STEP_S = 120.0


class OpenAIServer:
    model_type = "llm"  # what /v1/models says it serves (an embedding server: "embeddings")

    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.logprobs = LogprobFormatter(self.tokenizer)
        # Chosen once per model: how its answers carry tool calls and reasoning.
        self.tool_family, self.reasoning = model_parsers(
            self.tokenizer, config.tool_call_parser, config.reasoning_parser
        )
        self.metrics = Metrics(engine)
        self.created = now()

    # ---- plumbing -------------------------------------------------------------------------------
    def app(self) -> Starlette:
        middleware = []
        if self.config.allowed_origins:
            middleware.append(
                Middleware(
                    CORSMiddleware,
                    allow_origins=list(self.config.allowed_origins),
                    allow_methods=["*"],
                    allow_headers=["*"],
                )
            )
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.render_metrics, methods=["GET"]),
            Route("/v1/models", self.guarded(self.models, anthropic=None), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.guarded(self.model, anthropic=None), methods=["GET"]),
            Route("/v1/chat/completions", self.guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self.guarded(self.completions), methods=["POST"]),
            *EmbeddingRoutes(self).routes(),  # a 400 here; server/embedding_server.py serves embeddings
            *AnthropicRoutes(self).routes(),
            *ResponsesRoute(self).routes(),
        ]
        if self.config.web:
            routes += web_routes()
        return Starlette(
            routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error}
        )

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        # Routing errors (unknown path 404, wrong method 405) answer in OpenAI's error format too.
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        if from_anthropic_client(request):
            return anthropic_error_response(exc.status_code, message, headers=exc.headers)
        return error_response(exc.status_code, message, headers=exc.headers)

    def guarded(self, handler, anthropic: bool | None = False):
        """Key check and typed-error mapping around an API handler, answering in OpenAI's error shape
        (``anthropic``: in Anthropic's; None: in the shape of the client that asks, which for Anthropic's
        sends an ``anthropic-version`` header: the routes both clients use)."""

        async def wrapped(request: Request) -> Response:
            shape = from_anthropic_client(request) if anthropic is None else anthropic
            if not self.authorized(request):
                return unauthorized(shape)
            try:
                return await handler(request)
            except ClientDisconnect:
                # The client left before its body arrived: no one to answer, nothing went wrong here.
                return Response(status_code=499)
            except (MlxInferError, ValidationError) as e:
                return for_exception(e, shape)
            except Exception as e:  # noqa: BLE001 - an engine failure still answers in the API's format
                log.exception("request failed")
                return for_exception(e, shape)

        return wrapped

    def authorized(self, request: Request) -> bool:
        return authorized(request, self.config.api_key)

    async def _body(self, request: Request, schema):
        parsed = await read_json(request, schema, self.config.max_request_bytes)
        if parsed.model is None:  # one model is served: the body need not name it (as vLLM's)
            parsed.model = self.config.model_name
        if parsed.model != self.config.model_name:
            raise ModelNotFound(
                f"the model {parsed.model!r} does not exist; this server has {self.config.model_name!r}",
                param="model",
            )
        return parsed

    # ---- simple routes --------------------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """200 while requests are served; 503 with the reason once the engine has stopped or the
        server is shutting down, so a supervisor or load balancer stops sending work here."""
        if self.engine.failure is not None:
            reason = f"the engine has stopped: {self.engine.failure}"
            return JSONResponse({"status": "error", "reason": reason}, status_code=503)
        if self.engine.closed_reason is not None:
            return JSONResponse({"status": "shutting_down", "reason": self.engine.closed_reason}, 503)
        stalled = self.engine.stalled_for()
        if stalled > STALLED_STEP_S:
            reason = f"the engine's current step has run for {stalled:.0f} s (a stopped peer rank, a hang)"
            return JSONResponse({"status": "stalled", "reason": reason}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    def model_cards(self) -> list[dict[str, Any]]:
        """What ``/v1/models`` lists: the served model."""
        return [
            {
                "id": self.config.model_name,
                "object": "model",
                "created": self.created,
                "owned_by": "mlx-infer",
                "type": self.model_type,  # LM Studio's: llm or embeddings
                "context_length": self.context_length(),
                **self.config.model_details,
            }
        ]

    def context_length(self) -> int:
        return self.engine.engine.max_context

    async def models(self, request: Request) -> Response:
        cards = self.model_cards()
        if not from_anthropic_client(request):
            return JSONResponse({"object": "list", "data": cards})
        # Anthropic's list: the models its Messages API can answer with, a page at a time.
        return JSONResponse(_anthropic_page([c for c in cards if c.get("type") != "embeddings"], request))

    async def model(self, request: Request) -> Response:
        """``/v1/models/{id}`` (the OpenAI client's ``models.retrieve``, Anthropic's too): one card of the
        list."""
        wanted = request.path_params["model_id"]
        cards = self.model_cards()
        for card in cards:
            if card["id"] == wanted:
                return JSONResponse(_anthropic_card(card) if from_anthropic_client(request) else card)
        offered = ", ".join(repr(c["id"]) for c in cards)
        raise ModelNotFound(f"model: {wanted!r} does not exist; this server has {offered}", param="model")

    # ---- what every chat-like route shares --------------------------------------------------------
    def plan_chat(
        self,
        tools: list[dict[str, Any]] | None,
        tool_choice: ToolChoice,
        parallel: bool = True,
        template_kwargs: dict[str, Any] | None = None,
    ) -> ChatPlan:
        """How a chat request's prompt is rendered (tools written in for templates without them) and its
        answer parsed into text, reasoning and calls, with this model's parsers."""
        return prepare_chat(
            self.tokenizer,
            family=self.tool_family,
            reasoning=self.reasoning,
            tools=tools,
            tool_choice=tool_choice,
            parallel=parallel,
            template_kwargs=template_kwargs,
        )

    async def constrain(
        self,
        params: list[SamplingParams],
        plan: ChatPlan | None,
        requested: ConstraintSpec | None = None,
        field: str | None = None,
    ) -> list[SamplingParams]:
        """``params`` with the one constraint an answer follows: the call ``plan`` forces (tool_choice
        required or a named function: a response format then has no content to shape, as OpenAI's
        accepts both) or the format the request's ``field`` asks for. Compiled off the event loop (a large
        schema compiles for a while; the engine then finds it cached), so that one that does not compile
        is a 400 naming its field before anything is submitted. A forced call ends where its grammar
        does: stop strings, which could cut it inside its arguments, do not apply to it."""
        forced = plan.constraint if plan is not None else None
        if forced is not None:
            await self._compile_forced(plan)
            return [dataclasses.replace(p, constraint=forced, stop=[]) for p in params]
        if requested is not None:
            try:
                await run_in_threadpool(compile_constraint, requested, self.tokenizer)
            except InvalidRequest as e:
                raise InvalidRequest(f"{field}: {e}", param=field) from None
        return [dataclasses.replace(p, constraint=requested) for p in params]

    async def _compile_forced(self, plan: ChatPlan) -> None:
        try:
            await run_in_threadpool(compile_constraint, plan.constraint, self.tokenizer)
        except InvalidRequest:
            # The grammar of the calls is long and its error says little: name the tool at fault.
            for i, tool in enumerate(plan.tools):
                parameters = call_parameters(function_of(tool))
                try:
                    await run_in_threadpool(
                        compile_constraint, ConstraintSpec("json_schema", parameters), self.tokenizer
                    )
                except InvalidRequest as e:
                    raise InvalidRequest(f"tools.{i}.function.parameters: {e}", param="tools") from None
            raise InvalidRequest("tools: the calls they allow do not compile to a grammar", "tools") from None

    # ---- completions ----------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        # Templating and tokenizing a long prompt takes a while: off the loop that feeds every stream.
        # A conversation longer than the context loses whole turns or fails, per its policy.
        policy, max_prompt = request_policy(
            self.config.context_overflow, body.context_overflow, body.truncate_prompt_tokens
        )
        plan = self.plan_chat(
            body.tools,
            ToolChoice.parse(body.tool_choice),
            body.parallel_tool_calls,
            template_kwargs(body.chat_template_kwargs),
        )
        plan = dataclasses.replace(
            plan,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
        )
        engine, max_new = self.engine.engine, body.max_new_tokens()
        fitted = await run_in_threadpool(
            fit_for_engine, messages, plan.render, engine, max_new, policy, max_prompt
        )
        return await self._generate(request, body, [fitted.prompt_ids], chat=True, plan=plan)

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        prompts: list[list[int]] = []
        for prompt in body.prompts():
            if isinstance(prompt, str):
                prompts.append(await run_in_threadpool(self.tokenizer.encode, prompt))
                continue
            if any(not 0 <= t < self.tokenizer.vocab_size for t in prompt):
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", param="prompt"
                )
            prompts.append(list(prompt))
        return await self._generate(request, body, prompts, chat=False)

    async def _generate(
        self, request: Request, body, prompts: list[list[int]], chat: bool, plan: ChatPlan | None = None
    ) -> Response:
        """Submit ``body.n`` choices of each prompt (a chat request has one; completions a batch) as one
        group: choice ``k * n + j`` is choice ``j`` of prompt ``k``, as OpenAI numbers them."""
        longest = max(len(p) for p in prompts)
        max_tokens = body.max_new_tokens() or default_max_tokens(self.engine.engine, longest)
        logprobs = body.logprobs_count()
        params = [body.sampling_params(max_tokens, logprobs, i) for i in range(body.n)]
        params = await self.constrain(params, plan, body.constraint(), body.constraint_field())
        requests = [(prompt, p) for prompt in prompts for p in params]
        group = submit(self.engine, requests, "messages" if chat else "prompt")
        try:
            call = _Call(self, body, prompts, chat, group, plan)
        except BaseException:
            group.close()  # its requests' KV blocks go back at once
            raise
        if body.stream:
            return StreamingResponse(
                call.stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"}
            )
        try:
            await call.collect(request)
        except asyncio.CancelledError:
            group.close()
            raise
        if call.disconnected:
            return Response(status_code=499)
        return JSONResponse(call.final_body())


class _Call:
    """One API call's choices as they fill in, and the bodies sent for it."""

    def __init__(
        self,
        server: OpenAIServer,
        body,
        prompts: list[list[int]],
        chat: bool,
        group: RequestGroup,
        plan: ChatPlan | None = None,
    ):
        self.server = server
        self.body = body
        self.prompts = prompts
        self.num_prompt_tokens = sum(len(p) for p in prompts)
        self.chat = chat
        self.group = group
        self.choices = [Choice() for _ in range(len(prompts) * body.n)]
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.clock = LatencyClock(server.metrics, len(self.choices))
        self.disconnected = False
        # Each choice's echoed prompt (completions with echo), "" otherwise; with logprobs its tokens'
        # log-probabilities come with the choice's first output.
        self.echoes = [
            server.tokenizer.decode(prompts[i // body.n]) if not chat and body.echo else ""
            for i in range(len(self.choices))
        ]
        self.scores_prompt = body.prompt_logprobs_count() is not None
        # max_tokens 0 with echo: the one token the engine samples after the prompt is not returned.
        self.scores_only = body.scores_only
        # Chat answers split into content, reasoning and tool calls as they arrive, one parser a choice.
        self.parsers = [plan.parser(prompts[0]) for _ in range(body.n)] if plan is not None else None

    def _record(self, index: int, out) -> RequestOutput:
        """Take one output in (as the client sees it: without the token of a prompt only scored);
        returns it."""
        if self.scores_only:
            out = dataclasses.replace(
                out, token_ids=[], text="", logprobs=None, num_output_tokens=0, finish_reason="length"
            )
        self.choices[index].add(out)
        self.clock.record(index, out)
        return out

    def _events(self, index: int, out: RequestOutput) -> list[Event]:
        """What an output adds to a chat answer (parsed events)."""
        if self.parsers is None:
            return []
        parser = self.parsers[index]
        events = parser.feed(out.text) if out.text else []
        return events + parser.finish() if out.finished else events

    async def collect(self, request: Request) -> None:
        self.disconnected = not await collect(
            self.group, request, lambda index, out: self._events(index, self._record(index, out))
        )

    def _logprobs(self, entries, offset: int, prompt: list | None = None) -> dict[str, Any] | None:
        """The logprobs field of a choice (or of a chunk): ``entries`` from text offset ``offset``,
        after the echoed prompt's own (``prompt``: one entry a token) where it is scored."""
        if self.body.logprobs_count() is None:
            return None
        if self.chat:
            return self.server.logprobs.chat(entries)
        if prompt is None:
            return self.server.logprobs.completion(entries, offset)
        scored = self.server.logprobs.completion(prompt, 0)
        generated = self.server.logprobs.completion(entries, offset)
        return {key: scored[key] + generated[key] for key in scored}

    def final_body(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp = self._logprobs(c.logprobs, len(self.echoes[i]), c.prompt_logprobs)
            if self.chat:
                parsed = self.parsers[i].result
                message = chat_output.message(parsed)
                finish = chat_output.finish_reason(parsed, c.finish_reason)
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": finish})
            else:
                choices.append(
                    {
                        "index": i,
                        "text": self.echoes[i] + text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
            "usage": usage(self.num_prompt_tokens, self.choices),
            "system_fingerprint": None,
        }

    def _chunk(self, choices: list[dict[str, Any]], usage_body: dict[str, Any] | None = None) -> str:
        chunk = {
            "id": self.id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
            "system_fingerprint": None,
        }
        if self.body.stream_options and self.body.stream_options.include_usage:
            chunk["usage"] = usage_body
        return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"

    def _chat_chunks(self, index: int, events: list[Event], lp, engine_reason: str | None) -> list[str]:
        """One chunk per event (a call's start, then its argument fragments, as OpenAI streams them);
        the logprobs ride on the first, the finish reason on the last."""
        deltas = [chat_output.delta(e) for e in events]
        if not deltas and lp is None and engine_reason is None:
            return []  # text held back by a parser (a marker may be starting)
        deltas = deltas or [{}]
        reason = engine_reason and chat_output.finish_reason(self.parsers[index].result, engine_reason)
        return [
            self._chunk(
                [
                    {
                        "index": index,
                        "delta": d,
                        "logprobs": lp if j == 0 else None,
                        "finish_reason": reason if j == len(deltas) - 1 else None,
                    }
                ]
            )
            for j, d in enumerate(deltas)
        ]

    async def stream(self) -> AsyncIterator[str]:
        offsets = [len(echo) for echo in self.echoes]
        try:
            for i, echo in enumerate(self.echoes):
                if self.chat:
                    delta = {"role": "assistant", "content": ""}
                    yield self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                elif echo and not self.scores_prompt:
                    yield self._chunk([{"index": i, "text": echo, "logprobs": None, "finish_reason": None}])
            async for index, out in self.group:
                out = self._record(index, out)
                events = self._events(index, out)
                # A scored prompt's echo rides on its first output, with its tokens' log-probabilities.
                prompt = out.prompt_logprobs
                if not out.text and not out.finished and not out.logprobs and prompt is None:
                    continue
                lp = self._logprobs(out.logprobs or [], offsets[index], prompt)
                offsets[index] += len(out.text)
                if self.chat:
                    for chunk in self._chat_chunks(index, events, lp, out.finish_reason):
                        yield chunk
                    continue
                text = self.echoes[index] + out.text if prompt is not None else out.text
                body = {"index": index, "text": text, "logprobs": lp, "finish_reason": out.finish_reason}
                yield self._chunk([body])
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self._chunk([], usage(self.num_prompt_tokens, self.choices))
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the 200 header is sent: report any failure in the stream
            if not isinstance(e, MlxInferError):
                log.exception("request failed")
            yield f"data: {from_exception(e).body.decode()}\n\n"
            yield "data: [DONE]\n\n"  # the stream still ends as streams do (vLLM's too)
        finally:
            self.group.close()


def _anthropic_page(cards: list[dict[str, Any]], request: Request) -> dict[str, Any]:
    """Anthropic's page of models: ``limit`` (1 to 1000, default 20) of them after ``after_id`` or before
    ``before_id``, which its client pages through by the first and last id."""
    ids = [card["id"] for card in cards]
    query = request.query_params
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        limit = 0
    if not 1 <= limit <= 1000:
        raise InvalidRequest(f"limit: must be an integer from 1 to 1000, not {query.get('limit')!r}", "limit")
    start, end = 0, len(ids)
    for param in ("after_id", "before_id"):
        if query.get(param) is not None and query[param] not in ids:
            raise InvalidRequest(f"{param}: no model {query[param]!r} on this server", param)
    if "before_id" in query:
        end = ids.index(query["before_id"])
        start = max(end - limit, 0)
    else:
        start = ids.index(query["after_id"]) + 1 if "after_id" in query else 0
        end = min(start + limit, len(ids))
    data = [_anthropic_card(card) for card in cards[start:end]]
    more = start > 0 if "before_id" in query else end < len(ids)
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return {"data": data, "has_more": more, "first_id": first, "last_id": last}


def _anthropic_card(card: dict[str, Any]) -> dict[str, Any]:
    """A model card as Anthropic's ``models`` API gives it (its ``type`` is always ``model``, where
    OpenAI's card carries LM Studio's ``llm`` / ``embeddings``)."""
    created_at = datetime.fromtimestamp(card["created"], tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    context = card.get("context_length")
    limits = {"max_input_tokens": context, "max_tokens": context} if context else {}
    return {"id": card["id"], "type": "model", "display_name": card["id"], "created_at": created_at,
            "lifecycle": "active", **limits}  # fmt: skip
