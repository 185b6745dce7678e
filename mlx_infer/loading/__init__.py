"""Loading a model and its tokenizer from a folder, a Hub repo id or a GGUF file.

``load(spec)`` accepts:
- a local Hugging Face / MLX folder (``config.json`` + safetensors, sharded or not; an mlx-community
  ``quantization`` key makes the listed layers quantized),
- a Hub repo id (``org/name``), fetched with ``huggingface_hub`` or found in its cache offline,
- a ``.gguf`` file (or a folder holding exactly one and no ``config.json``).
The weights then pass the backend policy (``policy.py``) and are evaluated, so a corrupt file fails
here rather than at the first request.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.errors import InvalidCheckpoint, InvalidRequest, ModelNotFound
from mlx_infer.loading import hf, hub
from mlx_infer.loading.build import build_model
from mlx_infer.loading.fp8 import dequantize_fp8
from mlx_infer.loading.policy import apply_weight_policy, kquants_stay_raw, prepare_for_backend


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: Any  # mlx_infer.tokenizer.Tokenizer
    config: dict[str, Any]
    source: str  # the local file or folder the weights came from
    max_context: int
    weight_policy: str = ""  # one line, e.g. "weights: float32 (dequantized from 4-bit ...), 540 MB"


@dataclass
class Checkpoint:
    """A checkpoint opened but not built: what ``convert`` works from, and what ``load`` builds."""

    config: dict[str, Any]
    weights: dict[str, mx.array]  # Hugging Face names, lazy where the format allows (safetensors)
    tokenizer: Any  # mlx_infer.tokenizer.Tokenizer
    path: Path  # the .gguf file or the model folder
    requantize: dict[str, int] = field(default_factory=dict)  # see policy.py
    kquants: dict[str, str] = field(default_factory=dict)  # module path -> GGUF kind of a raw-block weight


def open_checkpoint(spec: str, kquant_blocks: bool = False) -> Checkpoint:
    """Config, HF-named weights and tokenizer of ``spec``; no model built, no weight policy applied.

    ``kquant_blocks``: GGUF Q4_K/Q5_K/Q6_K matrices stay raw blocks (see ``policy.kquants_stay_raw``).
    """
    from mlx_infer.tokenizer import Tokenizer

    path = resolve(spec)
    gguf_file = path if path.is_file() else single_gguf(path)
    if gguf_file is not None:
        from mlx_infer.loading.gguf import read_gguf

        gguf = read_gguf(gguf_file, kquant_blocks)
        tokenizer = Tokenizer.from_gguf_metadata(gguf.metadata)
        return Checkpoint(gguf.config, gguf.weights, tokenizer, gguf_file, gguf.requantize, gguf.kquants)
    config = hf.read_config(path)
    weights = dequantize_fp8(config, hf.read_weights(path))
    return Checkpoint(config, weights, Tokenizer.from_folder(path), path)


def load(
    spec: str, *, keep_quantized: bool | None = None, prepare: Callable[[nn.Module], None] | None = None
) -> LoadedModel:
    """Build the model of ``spec``, evaluate it and prepare it for this backend: the weight policy, then
    ``prepare``, then evaluation, then :func:`prepare_for_backend` (the one place a model is readied
    for what runs it).

    ``prepare`` runs on the built model before any weight is evaluated: weights it drops or slices
    (a distributed rank's shard) are then never read from lazy files.
    """
    # A distributed shard (``prepare``) slices weights by input columns in MLX's layouts; GGUF blocks
    # would need cuts on block boundaries, so shards take the re-quantized form.
    ckpt = open_checkpoint(spec, kquant_blocks=kquants_stay_raw(keep_quantized) and prepare is None)
    path, config = ckpt.path, ckpt.config
    model = build_model(config, ckpt.weights, path.name, ckpt.kquants)
    ckpt.weights = {}
    description = apply_weight_policy(model, keep_quantized, ckpt.requantize)
    if prepare is not None:
        prepare(model)
    try:
        mx.eval(model.parameters())
    except (RuntimeError, ValueError) as e:
        raise InvalidCheckpoint(f"{path.name}: {hf.one_line(e)}") from None
    prepare_for_backend(model)
    return LoadedModel(model, ckpt.tokenizer, config, str(path), _max_context(config, model), description)


def resolve(spec: str) -> Path:
    """The local file or folder ``spec`` names: a path, or a Hub repo id's snapshot."""
    path = Path(spec).expanduser()
    if path.exists():
        if path.is_file() and path.suffix != ".gguf":
            raise InvalidRequest(f"{spec}: not a .gguf file nor a model folder")  # a wrong path: exit 2
        return path
    if hub.looks_like_repo_id(spec):
        return hub.snapshot(spec)
    raise ModelNotFound(f"{spec}: no such file or folder")


def single_gguf(folder: Path) -> Path | None:
    """The one GGUF file of a folder without a config.json (a GGUF repo's snapshot), or None."""
    if (folder / "config.json").exists():
        return None
    found = sorted(folder.glob("*.gguf"))
    return found[0] if len(found) == 1 else None


def _max_context(config: dict[str, Any], model: nn.Module) -> int:
    text = config.get("text_config", config)
    value = text.get("max_position_embeddings") or getattr(model.args, "max_position_embeddings", None)
    return int(value or 4096)
