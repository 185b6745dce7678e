"""``serve`` on an embedding model: the embeddings route over an ``AsyncEmbedder``, no generation engine.

The app keeps the generation server's plumbing (API key, error shape, ``/health``, ``/v1/models``) and
answers the generation routes with a 400 that says this model only embeds.
"""

from __future__ import annotations

import argparse
import logging
import threading

from prometheus_client import CollectorRegistry, Gauge, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from mlx_infer.embedding import load_embedding_model
from mlx_infer.embedding_engine import AsyncEmbedder
from mlx_infer.errors import InvalidRequest
from mlx_infer.server.app import OpenAIServer, ServerConfig
from mlx_infer.server.embeddings import EmbeddingRoutes
from mlx_infer.server.lifecycle import Supervisor
from mlx_infer.server.responses import now

log = logging.getLogger("mlx_infer")

# What a generation server answers: here a 400 that says this model only embeds (other paths 404).
GENERATION_ROUTES = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/responses",
)


class EmbeddingServer(OpenAIServer):
    model_type = "embeddings"

    def __init__(self, embedder: AsyncEmbedder, config: ServerConfig):
        # Not OpenAIServer.__init__: there is no generation engine, tokenizer formatter or KV metrics.
        self.engine = embedder  # what /health and the lifecycle read (failure, closed_reason)
        self.embedder = embedder
        self.config = config
        self.created = now()
        self.registry = _metrics(embedder)

    def app(self) -> Starlette:
        middleware = []
        if self.config.allowed_origins:
            origins = list(self.config.allowed_origins)
            middleware.append(
                Middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"], allow_headers=["*"])
            )
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.render_metrics, methods=["GET"]),
            Route("/v1/models", self.guarded(self.models, anthropic=None), methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.guarded(self.model, anthropic=None), methods=["GET"]),
            *EmbeddingRoutes(self, self.embedder).routes(),
            # In the shape of the API asked (Anthropic's on /v1/messages).
            *(Route(p, self.guarded(self.not_served, None), methods=["POST"]) for p in GENERATION_ROUTES),
        ]
        return Starlette(
            routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error}
        )

    def context_length(self) -> int:
        return self.embedder.model.max_tokens  # the longest input embedded

    async def not_served(self, request: Request) -> Response:
        raise InvalidRequest(
            f"the model {self.config.model_name!r} is an embedding model: it answers POST /v1/embeddings, "
            f"not {request.url.path}",
            param="model",
        )

    async def render_metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")


def _metrics(embedder: AsyncEmbedder) -> CollectorRegistry:
    registry = CollectorRegistry()
    stats = embedder.stats
    gauges = {
        "mlx_infer_requests_pending": ("Requests admitted and unanswered", lambda: embedder.num_pending),
        "mlx_infer_embedding_requests_total": ("Embedding requests answered", lambda: stats.requests),
        "mlx_infer_embedding_inputs_total": ("Inputs embedded", lambda: stats.inputs),
        "mlx_infer_embedding_tokens_total": ("Input tokens embedded", lambda: stats.tokens),
        "mlx_infer_requests_failed_total": (
            "Requests that failed in a forward",
            lambda: stats.failed_requests,
        ),
    }
    for name, (text, read) in gauges.items():
        Gauge(name, text, registry=registry).set_function(read)
    return registry


def start_embedder(args: argparse.Namespace, spec: str) -> AsyncEmbedder:
    """Load the embedding model ``spec`` and start its batching engine.

    ``--max-num-seqs`` caps the inputs of one forward, ``--max-num-batched-tokens`` its padded tokens.
    """
    model = load_embedding_model(spec, pooling=args.pooling, keep_quantized=args.keep_quantized)
    log.info("%s: %s", model.source, model.weight_policy)
    log.info(
        "embedding model: %d dimensions, %s pooling%s, at most %d tokens per input",
        model.dimension,
        model.pooling.mode,
        ", normalized" if model.pooling.normalize else "",
        model.max_tokens,
    )
    return AsyncEmbedder(model, args.max_num_batched_tokens, args.max_num_seqs, args.max_pending)


def serve_embeddings(
    args: argparse.Namespace, config: ServerConfig, supervisor: Supervisor, stopped: threading.Event
) -> None:
    """Load the embedding model, hand the app to ``supervisor``, and serve until ``stopped``."""
    embedder = start_embedder(args, args.model)
    try:
        supervisor.ready(embedder, EmbeddingServer(embedder, config).app())
        log.info("serving embeddings of %r on http://%s:%d/v1", config.model_name, args.host, args.port)
        stopped.wait()
    finally:
        embedder.close()
