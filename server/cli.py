"""``mlx-infer serve``: an OpenAI-compatible endpoint over the continuous-batching engine."""

from __future__ import annotations

import argparse
import logging
import os
import socket
import sys
import threading
import time

from mlx_infer import cli_options, context_policy, reasoning, tool_calls
from mlx_infer.embed_cli import add_pooling_argument
from mlx_infer.engine.engine import EngineConfig
from mlx_infer.errors import EngineFailure, InvalidRequest
from mlx_infer.model_store import FIT_FRACTION, served_name
from mlx_infer.server.request_body import DEFAULT_MAX_REQUEST_BYTES

log = logging.getLogger("mlx_infer")

THREAD_EXIT_SECONDS = 0.2
DEFAULT_MAX_LOADED_MODELS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser, repeatable=True)  # several: server/multi_model.py
    add_pooling_argument(parser)  # an embedding model serves /v1/embeddings (server/embedding_server.py)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    g.add_argument("--port", type=cli_options.tcp_port, default=8080, help="port (default: 8080)")
    g.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send (default: the file stem, folder name or repo id as given)",
    )
    g.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="also serve every GGUF file and model folder under DIR, each named by its path inside it "
        "(default: none)",
    )
    g.add_argument(
        "--max-loaded-models",
        type=int,
        default=DEFAULT_MAX_LOADED_MODELS,
        metavar="N",
        help="with several models, most loaded at once; the least recently used idle one is unloaded "
        f"for another (default: {DEFAULT_MAX_LOADED_MODELS}, as Ollama)",
    )
    g.add_argument(
        "--models-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="with several models, most memory their weights and KV pools may hold together, in GiB "
        f"(default: {FIT_FRACTION * 100:.0f}%% of device memory, or of $MLX_INFER_MEMORY_BUDGET)",
    )
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on /v1/* (default: no key)",
    )
    g.add_argument("--no-web", action="store_true", help="do not serve the chat page at / (default: served)")
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
    g.add_argument(
        "--max-request-bytes",
        type=int,
        default=DEFAULT_MAX_REQUEST_BYTES,
        metavar="BYTES",
        help=f"largest request body; larger ones get 413 unread (default: {DEFAULT_MAX_REQUEST_BYTES})",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=cli_options.SHUTDOWN_TIMEOUT_S,
        metavar="SECONDS",
        help="on SIGTERM/SIGINT, how long running requests may finish before they are aborted (default: 30)",
    )
    g.add_argument(
        "--exit-on-engine-failure",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="exit (status 7) shortly after the engine thread stops, for a supervisor to restart the "
        "server (default: on)",
    )
    g.add_argument(
        "--kv-idle-release",
        type=float,
        default=EngineConfig.kv_idle_release,
        metavar="SECONDS",
        help="after this long without requests the KV pool gives back its memory and forgets the prefix "
        f"cache (default: {EngineConfig.kv_idle_release:g}; inf: never)",
    )
    g.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=tool_calls.CHOICES,
        metavar="NAME",
        help="how the model writes tool calls: "
        + ", ".join(tool_calls.FAMILIES)
        + " (aliases: "
        + ", ".join(f"{a}={f}" for a, f in tool_calls.registry.ALIASES.items())
        + "); 'none' parses "
        "none (default: auto, from the chat template and tokenizer)",
    )
    g.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=reasoning.CHOICES,
        metavar="NAME",
        help="split <think>...</think> reasoning into reasoning_content: think (alias qwen3, deepseek_r1) "
        "or none (default: auto, on when the chat template or vocabulary has <think>)",
    )
    cli_options.add_engine_arguments(parser, max_num_seqs=32)
    context_policy.add_argument(g, default="error")


def _check_flags(args: argparse.Namespace) -> bool:
    """Refuse bad flags before the port is bound; returns whether several models are served (else
    ``args.model`` becomes the one model's name, as the single-model path has always read it)."""
    cli_options.engine_config(args)
    several = len(args.model) != 1 or args.models_dir is not None
    if not several:
        args.model = args.model[0]
        from mlx_infer.embedding import is_embedding_model

        if cli_options.speculative_method(args) is not None and is_embedding_model(args.model, args.pooling):
            raise InvalidRequest("an embedding model generates nothing to speculate on: drop --speculative")
    elif not args.model and args.models_dir is None:
        raise InvalidRequest("name a model: -m MODEL (repeatable) or --models-dir DIR")
    elif args.served_model_name is not None:
        raise InvalidRequest("--served-model-name names one model; several are named after their files")
    elif "MLX_RANK" in os.environ:
        raise InvalidRequest("several models cannot be served under `mlx-infer launch`; serve one")
    if args.max_loaded_models <= 0:
        raise InvalidRequest(f"--max-loaded-models must be positive, not {args.max_loaded_models}")
    if args.models_memory is not None and not args.models_memory > 0:
        raise InvalidRequest(f"--models-memory must be positive, not {args.models_memory}")
    if args.max_request_bytes <= 0:
        raise InvalidRequest(f"--max-request-bytes must be positive, not {args.max_request_bytes}")
    if args.shutdown_timeout < 0:
        raise InvalidRequest(f"--shutdown-timeout must be >= 0, not {args.shutdown_timeout}")
    if not args.kv_idle_release >= 0:  # nan too
        raise InvalidRequest(f"--kv-idle-release must be >= 0, not {args.kv_idle_release}")
    return several


def check_address(host: str, port: int) -> None:
    """Bind ``host:port`` once before the model loads: uvicorn finds a busy port or an unknown host only
    when it starts, and then exits 3 or aborts."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        raise InvalidRequest(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run(args: argparse.Namespace) -> int:
    import uvicorn

    from mlx_infer.embedding import is_embedding_model
    from mlx_infer.engine.async_engine import AsyncEngine
    from mlx_infer.model_store import served_details
    from mlx_infer.plan_cli import check_before_serve
    from mlx_infer.server.app import OpenAIServer, ServerConfig
    from mlx_infer.server.embedding_server import serve_embeddings
    from mlx_infer.server.lifecycle import ServeServer, Supervisor
    from mlx_infer.server.multi_model import serve_models

    several = _check_flags(args)
    if not several:  # several models are checked one by one as they load (server/model_registry.py)
        check_before_serve(args)  # logs the memory plan; refuses weights that cannot fit (one line)
    if os.environ.get("MLX_RANK", "0") != "0":
        # A follower rank under `mlx-infer launch`: it runs its shard of rank 0's steps; rank 0 serves.
        with cli_options.open_engine(args):
            return 0

    check_address(args.host, args.port)
    origins = tuple(o.strip() for o in args.allowed_origins.split(",") if o.strip())
    server_config = ServerConfig(
        "" if several else served_name(args.model, args.served_model_name),  # several: each its own
        args.api_key,
        origins,
        args.max_request_bytes,
        context_overflow=args.context_overflow,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
    )
    server_config.web = not args.no_web
    supervisor = Supervisor(web=not args.no_web)
    stopped = threading.Event()

    def load_and_serve() -> None:
        # The port answers (503) while this thread loads; the engine lives until the server stops.
        try:
            if several:
                serve_models(args, server_config, supervisor, stopped)
                return
            if is_embedding_model(args.model, args.pooling):
                serve_embeddings(args, server_config, supervisor, stopped)
                return
            with cli_options.open_engine(args) as (loaded, engine):
                log.info("%s: %s", loaded.source, loaded.weight_policy)
                server_config.model_details = served_details(loaded.source)
                async_engine = AsyncEngine(engine, max_pending=args.max_pending)
                try:
                    supervisor.ready(async_engine, OpenAIServer(async_engine, server_config).app())
                    log.info("serving %r on http://%s:%d/v1", server_config.model_name, args.host, args.port)
                    stopped.wait()
                finally:
                    async_engine.close()
        except BaseException as e:  # noqa: BLE001 - handed to the main thread, which reports it
            supervisor.load_failed(e)

    # Daemon: a stop requested while the model still loads does not wait for the load to finish.
    loader = threading.Thread(target=load_and_serve, name="mlx-infer-loader", daemon=True)
    loader.start()
    config = uvicorn.Config(
        supervisor,
        host=args.host,
        port=args.port,
        log_level="warning",
        timeout_keep_alive=30,
        # A backstop: --shutdown-timeout already ends every request; this cuts off clients that stall.
        timeout_graceful_shutdown=args.shutdown_timeout + 10,
    )
    server = ServeServer(config, supervisor, args.shutdown_timeout, args.exit_on_engine_failure)
    server.run()
    if supervisor.engine is None and supervisor.load_error is None:
        # Stopped while the model loads: nothing is served or written yet, and the loader thread is in
        # MLX's native code, which an interpreter shutting down around it aborts (SIGABRT, "terminate
        # called without an active exception"). Leave without the interpreter's teardown.
        log.info("stopped while the model was loading")
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(130 if server.interrupted else 0)
    stopped.set()
    if supervisor.engine is not None:
        loader.join(timeout=30)  # closes the engine thread, then the engine
        # A thread that used MLX runs MLX's thread-local destructors after join() returns, and they take
        # the GIL: if the interpreter is finalizing by then, the process aborts (SIGABRT) instead of
        # exiting. Sleeping hands them the GIL first.
        time.sleep(THREAD_EXIT_SECONDS)
    if supervisor.load_error is not None:
        raise supervisor.load_error
    if server.engine_failed:
        raise EngineFailure(f"the engine has stopped: {supervisor.engine.failure}")
    return 130 if server.interrupted else 0
