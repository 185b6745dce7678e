"""The starlette application: OpenAI-compatible routes over an AsyncEngine. No model code here."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
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

from mlx_infer.constraints import compile_constraint
from mlx_infer.engine.async_engine import AsyncEngine, RequestGroup
from mlx_infer.errors import InvalidRequest, MlxInferError, ModelNotFound
from mlx_infer.server.embeddings import EmbeddingRoutes
from mlx_infer.server.errors import error_response, from_exception
from mlx_infer.server.metrics import Metrics
from mlx_infer.server.request_body import DEFAULT_MAX_REQUEST_BYTES, read_json
from mlx_infer.server.responses import Choice, LogprobFormatter, new_id, now, usage
from mlx_infer.server.schemas import ChatCompletionRequest, CompletionRequest

DISCONNECT_POLL_SECONDS = 0.5

log = logging.getLogger("mlx_infer")


@dataclass
class ServerConfig:
    model_name: str
    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ()
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig):
        self.engine = engine
        self.config = config
        self.tokenizer = engine.engine.tokenizer
        self.logprobs = LogprobFormatter(self.tokenizer)
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
            Route("/v1/models", self.guarded(self.models), methods=["GET"]),
            Route("/v1/chat/completions", self.guarded(self.chat_completions), methods=["POST"]),
            Route("/v1/completions", self.guarded(self.completions), methods=["POST"]),
            *EmbeddingRoutes(self).routes(),  # a 400 here; server/embedding_server.py serves embeddings
        ]
        return Starlette(
            routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error}
        )

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        # Routing errors (unknown path 404, wrong method 405) answer in OpenAI's error format too.
        if exc.status_code == 404:
            message = f"no route {request.method} {request.url.path}"
        else:
            message = f"{request.method} {request.url.path}: {exc.detail}"
        return error_response(exc.status_code, message, headers=exc.headers)

    def guarded(self, handler):
        """Bearer-key check, JSON parsing and typed-error mapping around an API handler."""

        async def wrapped(request: Request) -> Response:
            if self.config.api_key is not None:
                # Constant-time comparison: the time a mismatch takes must not reveal the key's prefix.
                given = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(given, f"Bearer {self.config.api_key}".encode()):
                    return error_response(401, "invalid or missing API key", "authentication_error")
            try:
                return await handler(request)
            except ClientDisconnect:
                # The client left before its body arrived: no one to answer, nothing went wrong here.
                return Response(status_code=499)
            except (MlxInferError, ValidationError) as e:
                return from_exception(e)
            except Exception as e:  # noqa: BLE001 - an engine failure still answers in OpenAI's format
                log.exception("request failed")
                return from_exception(e)

        return wrapped

    async def _body(self, request: Request, schema):
        parsed = await read_json(request, schema, self.config.max_request_bytes)
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
        return JSONResponse({"status": "ok"})

    async def render_metrics(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def models(self, request: Request) -> Response:
        model = {
            "id": self.config.model_name,
            "object": "model",
            "created": self.created,
            "owned_by": "mlx-infer",
        }
        return JSONResponse({"object": "list", "data": [model]})

    # ---- completions ----------------------------------------------------------------------------
    async def chat_completions(self, request: Request) -> Response:
        body: ChatCompletionRequest = await self._body(request, ChatCompletionRequest)
        try:
            messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in body.messages]
        except ValueError as e:
            raise InvalidRequest(str(e), param="messages") from None
        # Templating and tokenizing a long prompt takes a while: off the loop that feeds every stream.
        prompt_ids = await run_in_threadpool(self.tokenizer.encode_chat, messages, tools=body.tools)
        return await self._generate(request, body, prompt_ids, chat=True)

    async def completions(self, request: Request) -> Response:
        body: CompletionRequest = await self._body(request, CompletionRequest)
        if isinstance(body.prompt, str):
            prompt_ids = await run_in_threadpool(self.tokenizer.encode, body.prompt)
        else:
            if any(not 0 <= t < self.tokenizer.vocab_size for t in body.prompt):
                raise InvalidRequest(
                    f"prompt token ids must be in [0, {self.tokenizer.vocab_size})", param="prompt"
                )
            prompt_ids = list(body.prompt)
        return await self._generate(request, body, prompt_ids, chat=False)

    async def _generate(self, request: Request, body, prompt_ids: list[int], chat: bool) -> Response:
        engine = self.engine.engine
        room = min(engine.max_context, engine.pool_tokens) - len(prompt_ids)
        max_tokens = body.max_new_tokens() or max(room, 1)
        logprobs = body.logprobs_count()
        constraint = body.constraint()
        if constraint is not None:
            # A large schema compiles for a while: off the event loop (the engine then finds it cached).
            await run_in_threadpool(compile_constraint, constraint, self.tokenizer)
        group = self.engine.submit(
            [(prompt_ids, body.sampling_params(max_tokens, logprobs, i)) for i in range(body.n)]
        )
        call = _Call(self, body, prompt_ids, chat, group)
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

    def __init__(self, server: OpenAIServer, body, prompt_ids: list[int], chat: bool, group: RequestGroup):
        self.server = server
        self.body = body
        self.prompt_ids = prompt_ids
        self.chat = chat
        self.group = group
        self.choices = [Choice() for _ in range(body.n)]
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = now()
        self.start = time.perf_counter()
        self.first_token: list[float | None] = [None] * body.n
        self.disconnected = False
        self.echo = "" if chat or not body.echo else server.tokenizer.decode(prompt_ids)

    def _record(self, index: int, out) -> None:
        self.choices[index].add(out)
        t = time.perf_counter()
        if self.first_token[index] is None:
            self.first_token[index] = t
        if out.finished:
            first = self.first_token[index]
            n = self.choices[index].num_output_tokens
            tpot = (t - first) / (n - 1) if n > 1 else None
            self.server.metrics.observe(first - self.start, tpot)

    async def collect(self, request: Request) -> None:
        # Check for a disconnect on a clock, not only when outputs pause: a request that streams a
        # token more often than every DISCONNECT_POLL_SECONDS would otherwise never be checked.
        next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
        try:
            while not self.group.done:
                wait = next_check - time.monotonic()
                if wait <= 0:
                    if await request.is_disconnected():
                        self.disconnected = True
                        return
                    next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                    continue
                try:
                    index, out = await asyncio.wait_for(self.group.next(), wait)
                except asyncio.TimeoutError:
                    continue
                self._record(index, out)
        finally:
            self.group.close()

    def _logprobs(self, choice: Choice, entries, offset: int) -> dict[str, Any] | None:
        if self.body.logprobs_count() is None:
            return None
        if self.chat:
            return self.server.logprobs.chat(entries)
        return self.server.logprobs.completion(entries, offset)

    def final_body(self) -> dict[str, Any]:
        choices = []
        for i, c in enumerate(self.choices):
            text = "".join(c.text)
            lp = self._logprobs(c, c.logprobs, len(self.echo))
            if self.chat:
                message = {"role": "assistant", "content": text}
                choices.append(
                    {"index": i, "message": message, "logprobs": lp, "finish_reason": c.finish_reason}
                )
            else:
                choices.append(
                    {"index": i, "text": self.echo + text, "logprobs": lp, "finish_reason": c.finish_reason}
                )
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.body.model,
            "choices": choices,
            "usage": usage(len(self.prompt_ids), self.choices),
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

    async def stream(self) -> AsyncIterator[str]:
        offsets = [len(self.echo)] * self.body.n
        try:
            for i in range(self.body.n):
                if self.chat:
                    delta = {"role": "assistant", "content": ""}
                    yield self._chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
                elif self.echo:
                    yield self._chunk(
                        [{"index": i, "text": self.echo, "logprobs": None, "finish_reason": None}]
                    )
            async for index, out in self.group:
                self._record(index, out)
                choice = self.choices[index]
                if not out.text and not out.finished and not out.logprobs:
                    continue
                lp = self._logprobs(choice, out.logprobs or [], offsets[index])
                offsets[index] += len(out.text)
                if self.chat:
                    delta = {"content": out.text} if out.text else {}
                    body = {
                        "index": index,
                        "delta": delta,
                        "logprobs": lp,
                        "finish_reason": out.finish_reason,
                    }
                else:
                    body = {
                        "index": index,
                        "text": out.text,
                        "logprobs": lp,
                        "finish_reason": out.finish_reason,
                    }
                yield self._chunk([body])
            if self.body.stream_options and self.body.stream_options.include_usage:
                yield self._chunk([], usage(len(self.prompt_ids), self.choices))
            yield "data: [DONE]\n\n"
        except Exception as e:  # noqa: BLE001 - the 200 header is sent: report any failure in the stream
            if not isinstance(e, MlxInferError):
                log.exception("request failed")
            yield f"data: {from_exception(e).body.decode()}\n\n"
        finally:
            self.group.close()
