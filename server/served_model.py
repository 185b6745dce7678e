"""The models ``serve -m A -m B`` / ``--models-dir DIR`` offers, and one of them loaded with its own app.

Each loaded model gets what ``serve`` gives a single model: its engine thread (or an embedding engine)
and an ``OpenAIServer`` (or ``EmbeddingServer``) app whose ``model_name`` is the model's name, so every
API surface checks and answers requests for it as it does today. Unloading stops the engine and drops
every reference to the weights and the KV pool before MLX's buffer cache is cleared.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
from contextlib import ExitStack
from pathlib import Path

import mlx.core as mx
from mlx.utils import tree_flatten
from prometheus_client import CollectorRegistry
from starlette.types import ASGIApp

from mlx_infer import cli_options, model_store
from mlx_infer.embedding import is_embedding_model
from mlx_infer.engine.async_engine import AsyncEngine
from mlx_infer.errors import InvalidRequest, MlxInferError
from mlx_infer.kv.memory import kv_budget_bytes
from mlx_infer.loading import resolve, single_gguf
from mlx_infer.model_store import served_name
from mlx_infer.plan import make_plan
from mlx_infer.server.app import OpenAIServer, ServerConfig
from mlx_infer.server.embedding_server import EmbeddingServer, start_embedder
from mlx_infer.server.model_registry import Engine, ModelSpec

log = logging.getLogger("mlx_infer")


def model_kind(path: str, pooling: str | None) -> str:
    """What a model serves, in LM Studio's words: ``llm`` or ``embeddings``."""
    return "embeddings" if is_embedding_model(path, pooling) else "llm"


def model_specs(models: list[str], models_dir: str | None, pooling: str | None = None) -> list[ModelSpec]:
    """Every model offered: each ``-m`` (named as a single model is: file stem, folder name or repo
    id), then each GGUF file and model folder under ``models_dir`` (named by its path inside it).
    Each is typed ``llm`` or ``embeddings`` (LM Studio's words), so that the chat page offers only
    the models that chat."""
    found: list[tuple[str, model_store.LocalModel, str]] = []
    for spec in models:
        local = model_store.local_model(resolve(spec))  # a missing model fails at start, not on first use
        kind = model_kind(local.path, pooling)
        found.append((served_name(spec, None), local, kind))
    if models_dir is not None:
        root = Path(models_dir).expanduser()
        if not root.is_dir():
            raise InvalidRequest(f"--models-dir {models_dir}: not a folder")
        for local in model_store.models_in(root):
            relative = Path(local.path).relative_to(root)
            name = str(relative.with_suffix("") if relative.suffix == ".gguf" else relative)
            # One broken download does not keep the folder's other models from being served.
            if local.architecture == "?":
                log.warning("--models-dir: %s is left out: its header or config cannot be read", local.path)
                continue
            try:
                kind = model_kind(local.path, pooling)
            except MlxInferError as e:
                log.warning("--models-dir: %s is left out: %s", local.path, e)
                continue
            found.append((name, local, kind))
        if not found:
            raise InvalidRequest(f"--models-dir {models_dir}: no GGUF file or model folder in it")
    specs, paths = [], {}
    for name, local, kind in found:
        if name in paths:
            raise InvalidRequest(
                f"two models are named {name!r} ({paths[name]} and {local.path}); rename one"
            )
        paths[name] = local.path
        details = {"type": kind, "architecture": local.architecture, "quantization": local.quantization}
        specs.append(ModelSpec(name, local.path, local.size, details))
    return specs


def estimate_bytes(args: argparse.Namespace, spec: ModelSpec) -> int:
    """What loading ``spec`` will take, before it is loaded: its weights as the load policy will hold
    them (the memory planner, from headers) plus its KV pool's budget (``--kv-memory`` or the default
    share of what is free now, at most ``--max-num-seqs`` full contexts). An embedding model has no
    pool; a model the planner cannot read is counted at its size on disk. Once loaded, the footprint
    measured on the loaded model counts instead."""
    if is_embedding_model(spec.path, args.pooling):
        return spec.size
    kv = kv_budget_bytes(args.kv_memory)
    try:
        plan = make_plan(
            spec.path,
            context=args.max_context,
            max_num_seqs=args.max_num_seqs,
            kv_cache_dtype=getattr(args, "kv_cache_dtype", "auto"),
            keep_quantized=args.keep_quantized,
            step_tokens=args.max_num_batched_tokens,
        )
    except MlxInferError:
        return spec.size + kv
    return plan.weights_bytes + min(kv, plan.kv_bytes)


def declared_context(path: str) -> int | None:
    """The context length a model's headers declare (``/v1/models`` of a model not loaded)."""
    try:
        p = Path(path)
        p = (single_gguf(p) or p) if p.is_dir() else p  # a GGUF repo's snapshot: its file
        if p.is_file():
            from mlx_infer.loading.gguf_file import read_header

            meta = read_header(p).metadata
            value = meta.get(f"{meta.get('general.architecture')}.context_length")
        else:
            config = json.loads((p / "config.json").read_text())
            value = config.get("max_position_embeddings") or config.get("text_config", {}).get(
                "max_position_embeddings"
            )
            # A sentence-transformers model embeds at most its max_seq_length (as the loaded one says).
            sentence = p / "sentence_bert_config.json"
            if sentence.is_file():
                limit = json.loads(sentence.read_text()).get("max_seq_length")
                value = min(int(v) for v in (value, limit) if v) if value or limit else None
        return int(value) if value else None
    except (OSError, ValueError, TypeError):
        return None


@dataclasses.dataclass
class ServedModel:
    """One loaded model (model_registry.Loaded)."""

    app: ASGIApp
    engine: Engine
    footprint: int
    context_length: int
    metrics: CollectorRegistry
    resources: ExitStack  # what loaded it (open_engine's context), closed at unload

    def close(self) -> None:
        self.resources.close()  # the engine thread first, then what loaded the model
        # The registry still holds this object: drop what holds the weights and the KV pool before
        # collecting, so that their buffers are really freed and the cache clear gives them back.
        del self.app, self.engine, self.metrics, self.resources
        gc.collect()
        mx.clear_cache()


def load_served(args: argparse.Namespace, base: ServerConfig, spec: ModelSpec) -> ServedModel:
    """Load ``spec`` with ``serve``'s flags and build its app (runs on the registry's loader thread)."""
    # CORS and the chat page belong to the server in front (server/multi_model.py), not to each model.
    config = dataclasses.replace(
        base, model_name=spec.name, allowed_origins=(), web=False, model_details=dict(spec.details)
    )
    resources = ExitStack()
    try:
        if is_embedding_model(spec.path, args.pooling):
            embedder = start_embedder(args, spec.path)
            resources.callback(embedder.close)
            server = EmbeddingServer(embedder, config)
            weights = _weights_bytes(embedder.model.model)
            return ServedModel(
                server.app(), embedder, weights, embedder.model.max_tokens, server.registry, resources
            )
        model_args = argparse.Namespace(**{**vars(args), "model": spec.path})
        loaded, engine = resources.enter_context(cli_options.open_engine(model_args))
        log.info("%s: %s", loaded.source, loaded.weight_policy)
        async_engine = AsyncEngine(engine, max_pending=args.max_pending)
        resources.callback(async_engine.close)
        server = OpenAIServer(async_engine, config)
        footprint = _weights_bytes(loaded.model) + engine.kv_memory().budget
        return ServedModel(
            server.app(), async_engine, footprint, engine.max_context, server.metrics.registry, resources
        )
    except BaseException:
        resources.close()
        raise


def _weights_bytes(model) -> int:
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))
