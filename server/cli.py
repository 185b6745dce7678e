"""``mlx-infer serve``: an OpenAI-compatible endpoint over the continuous-batching engine."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from mlx_infer import cli_options

log = logging.getLogger("mlx_infer")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=int, default=8080, help="port (default: 8080)")
    g.add_argument(
        "--served-model-name", default=None, help="model id clients send (default: the model's name)"
    )
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' (default: no key)")
    g.add_argument(
        "--allowed-origins",
        default="",
        metavar="ORIGINS",
        help="comma-separated CORS origins, '*' for any (default: CORS off)",
    )
    g.add_argument(
        "--max-pending",
        type=int,
        default=256,
        help="requests admitted but unfinished before new ones get 429 (default: 256)",
    )
    cli_options.add_engine_arguments(parser, max_num_seqs=32)


def served_name(model: str, explicit: str | None) -> str:
    if explicit:
        return explicit
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model)


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from mlx_infer.engine.async_engine import AsyncEngine
    from mlx_infer.server.app import OpenAIServer, ServerConfig

    with cli_options.open_engine(args) as opened:
        if opened is None:  # a follower rank under `mlx-infer launch`: rank 0 serves
            return 0
        loaded, engine = opened
        log.info("%s: %s", loaded.source, loaded.weight_policy)
        async_engine = AsyncEngine(engine, max_pending=args.max_pending)
        origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
        server_config = ServerConfig(served_name(args.model, args.served_model_name), args.api_key, origins)
        app = OpenAIServer(async_engine, server_config).app()
        log.info("serving %r on http://%s:%d/v1", server_config.model_name, args.host, args.port)
        try:
            uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=30)
        finally:
            async_engine.close()
    return 0
