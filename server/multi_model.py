"""``serve`` of several models: one app in front of a ModelRegistry.

Every route that names a model (the POST routes of each API surface) is sent, by the body's
``model`` field, to that model's own app (server/served_model.py), loaded first if needed; the body is
read once here and handed on as it came, so each surface validates and answers it as it does for a
single model. Requests to different models run on different engine threads and never wait for each
other. The app in front answers what belongs to no one model: ``/health``, ``/metrics`` (each loaded
model's metrics labelled ``model="NAME"``, and the registry's own), ``/v1/models`` (every model offered,
with its state) and the chat page.

A body without ``model`` is a 400 naming the models (Ollama and llama-swap refuse it too), unless only
one is offered; an unknown name is a 404 with OpenAI's code ``model_not_found`` (Anthropic's shape on
``/v1/messages``) naming the models offered and loaded; a model too large for the budget is a 400 that
gives both in bytes; one that must wait too long for room is a 503.
"""

from __future__ import annotations

import argparse
import logging
import threading
from functools import partial

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from mlx_infer import model_store
from mlx_infer.errors import InvalidRequest, MlxInferError
from mlx_infer.server.app import STALLED_STEP_S, OpenAIServer, ServerConfig
from mlx_infer.server.errors import anthropic_shaped, for_exception, unauthorized
from mlx_infer.server.lifecycle import Supervisor
from mlx_infer.server.model_registry import GIB, ModelRegistry
from mlx_infer.server.request_body import PARSE_INLINE_BYTES, parse_object, read_body
from mlx_infer.server.responses import now
from mlx_infer.server.served_model import declared_context, estimate_bytes, load_served, model_specs
from mlx_infer.server.web import routes as web_routes

log = logging.getLogger("mlx_infer")

# The routes whose body names a model: those of OpenAIServer.app() and EmbeddingServer.app() that
# generate or embed. Anything else is answered here.
MODEL_ROUTES = frozenset(
    {
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/v1/responses",
    }
)


class MultiModelServer(OpenAIServer):
    def __init__(self, registry: ModelRegistry, config: ServerConfig, contexts: dict[str, int | None]):
        # Not OpenAIServer.__init__: no engine of its own; its key check and error pages are reused.
        self.registry = registry
        self.config = config
        self.contexts = contexts  # declared context lengths, for models not loaded
        self.created = now()
        self.metrics_registry = _metrics(registry)

    def app(self) -> ASGIApp:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.render_metrics, methods=["GET"]),
            Route("/v1/models", self.guarded(self.models, anthropic=None), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.guarded(self.model, anthropic=None), methods=["GET"]),
        ]
        if self.config.web:
            routes += web_routes()
        self._front = Starlette(routes=routes, exception_handlers={HTTPException: self._http_error})
        if not self.config.allowed_origins:
            return self._route
        origins = list(self.config.allowed_origins)
        return CORSMiddleware(self._route, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])

    async def _route(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in MODEL_ROUTES:
            await self._dispatch(scope, receive, send)
        else:
            await self._front(scope, receive, send)

    async def _dispatch(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = Request(scope, receive)
        anthropic = anthropic_shaped(scope["path"], request.headers)
        if not self.authorized(request):
            await unauthorized(anthropic)(scope, receive, send)
            return
        try:
            raw = await read_body(request, self.config.max_request_bytes)
            name = await self._model_of(raw)
            loaded = await self.registry.acquire(name)
        except ClientDisconnect:
            await Response(status_code=499)(scope, receive, send)
            return
        except MlxInferError as e:
            await for_exception(e, anthropic)(scope, receive, send)
            return
        try:
            # Held until the model's app returns, which for a stream is when its last event is sent.
            await loaded.app(scope, _replay(raw, receive), send)
        finally:
            self.registry.release(name)

    async def _model_of(self, raw: bytes) -> str:
        small = len(raw) <= PARSE_INLINE_BYTES
        body = parse_object(raw) if small else await run_in_threadpool(parse_object, raw)
        model = body.get("model")
        if isinstance(model, str):
            return model
        if len(self.registry.specs) == 1:
            # The model's own app says what is wrong with the field, as a single model's server does.
            return next(iter(self.registry.specs))
        raise InvalidRequest(
            f"model: required; this server serves {self.registry.available()}", param="model"
        )

    # ---- what belongs to no one model ------------------------------------------------------------
    async def health(self, request: Request) -> Response:
        """200 while requests are served, with each model's state; 503 once a loaded model's engine has
        stopped (``serve`` then exits, as for a single model) or the server is shutting down."""
        models = {name: self.registry.state(name) for name in self.registry.specs}
        if self.registry.failure is not None:
            reason = f"the engine of {self.registry.failure}"
            return JSONResponse({"status": "error", "reason": reason, "models": models}, status_code=503)
        if self.registry.closed_reason is not None:
            body = {"status": "shutting_down", "reason": self.registry.closed_reason, "models": models}
            return JSONResponse(body, status_code=503)
        stalled = self.registry.stalled(STALLED_STEP_S)
        if stalled is not None:
            return JSONResponse({"status": "stalled", "reason": stalled, "models": models}, status_code=503)
        return JSONResponse({"status": "ok", "models": models})

    async def render_metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.metrics_registry), media_type="text/plain; version=0.0.4")

    def model_cards(self) -> list[dict]:
        """Every model offered, with its state (loaded or not) and size."""
        loaded = self.registry.loaded()
        data = []
        for name, spec in self.registry.specs.items():
            served = loaded.get(name)
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "mlx-infer",
                    "state": self.registry.state(name),
                    "context_length": served.context_length if served else self.contexts.get(name),
                    **spec.details,
                    "size_bytes": spec.size,
                }
            )
        return data


def _replay(raw: bytes, receive: Receive) -> Receive:
    """``receive`` with the body, already read, given again first; then the client's own messages
    (a disconnect), which the model's app watches for."""
    sent = False

    async def replayed():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": raw, "more_body": False}
        return await receive()

    return replayed


class _PerModel(Collector):
    """Each loaded model's own metrics, every sample labelled with the model's name."""

    def __init__(self, registry: ModelRegistry):
        self.registry = registry

    def collect(self):
        families: dict[str, Metric] = {}
        for name, loaded in self.registry.loaded().items():
            for family in loaded.metrics.collect():
                merged = families.get(family.name)
                if merged is None:
                    merged = Metric(family.name, family.documentation, family.type, family.unit)
                    families[family.name] = merged
                for s in family.samples:
                    merged.add_sample(s.name, {"model": name, **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from families.values()


def _metrics(registry: ModelRegistry) -> CollectorRegistry:
    r = CollectorRegistry()
    r.register(_PerModel(registry))
    stats = registry.stats
    gauges = {
        "mlx_infer_models_offered": ("Models this server can load", lambda: len(registry.specs)),
        "mlx_infer_models_loaded": ("Models loaded now", lambda: len(registry.loaded())),
        "mlx_infer_models_bytes_used": ("Bytes the loaded models hold", registry.used_bytes),
        "mlx_infer_models_bytes_budget": ("Bytes the models may hold", lambda: registry.memory_budget),
        "mlx_infer_model_loads_total": ("Models loaded since start", lambda: stats.loads),
        "mlx_infer_model_unloads_total": ("Models unloaded since start", lambda: stats.unloads),
        "mlx_infer_model_last_load_seconds": ("How long the last load took", lambda: stats.last_load_seconds),
    }
    for name, (text, read) in gauges.items():
        Gauge(name, text, registry=r).set_function(read)
    return r


def serve_models(
    args: argparse.Namespace, config: ServerConfig, supervisor: Supervisor, stopped: threading.Event
) -> None:
    """Offer every model of ``-m`` and ``--models-dir``, none loaded yet; serve until ``stopped``."""
    specs = model_specs(args.model, args.models_dir, args.pooling)
    budget = model_store.memory_budget() if args.models_memory is None else int(args.models_memory * GIB)
    registry = ModelRegistry(
        specs,
        partial(load_served, args, config),
        partial(estimate_bytes, args),
        args.max_loaded_models,
        budget,
    )
    contexts = {}
    for spec in specs:
        declared = declared_context(spec.path)
        contexts[spec.name] = min(declared, args.max_context) if declared and args.max_context else declared
    try:
        supervisor.ready(registry, MultiModelServer(registry, config, contexts).app())
        log.info(
            "serving %d model%s on http://%s:%d/v1 (%s), loaded on first use: at most %d at once within "
            "%.2f GiB",
            len(specs),
            "" if len(specs) == 1 else "s",
            args.host,
            args.port,
            registry.available(),
            args.max_loaded_models,
            budget / GIB,
        )
        stopped.wait()
    finally:
        registry.close()
