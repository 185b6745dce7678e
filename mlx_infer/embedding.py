"""Embedding models: one vector per input text, from an encoder or a decoder checkpoint.

Two kinds, chosen from the checkpoint:

- encoders of the BERT family (``models/bert.py``), as sentence-transformers ships them: a folder with
  ``modules.json`` (Transformer -> Pooling -> optional Normalize), ``1_Pooling/config.json`` (mean, CLS
  or last-token pooling) and ``sentence_bert_config.json`` (``max_seq_length``);
- decoders of the zoo (Qwen3-Embedding style: last-token pooling, normalized), run through the same
  layers and paged attention as generation over a scratch KV pool that lives for one forward only. A
  decoder is an embedding model when its folder has a sentence-transformers Pooling module, or when the
  caller names a pooling (``--pooling``).

A batch of inputs is one forward: encoders take a right-padded batch with an attention mask, decoders a
ragged batch (causal attention per sequence through the block tables), so each row gets what it would
get alone, up to float32 rounding of the batched products.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from mlx_infer.errors import ContextTooLong, InvalidCheckpoint, InvalidRequest, UnsupportedArchitecture
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import hf, open_checkpoint, resolve
from mlx_infer.loading.build import build_model
from mlx_infer.loading.policy import apply_weight_policy
from mlx_infer.models import ENCODER_TYPES, encoder_module

POOLING_MODES = ("mean", "cls", "last")
# sentence-transformers' Pooling config keys -> our modes (the others: max, sqrt-len, weighted mean).
_ST_POOLING_KEYS = {
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_cls_token": "cls",
    "pooling_mode_lasttoken": "last",
}
_ST_MODULE = "sentence_transformers.models."
SCRATCH_BLOCK_SIZE = 16  # tokens per block of a decoder's one-forward KV pool


@dataclass(frozen=True)
class Pooling:
    mode: str  # one of POOLING_MODES
    normalize: bool  # unit length (cosine similarity = dot product)


@dataclass(frozen=True)
class SentenceTransformersConfig:
    """What a sentence-transformers folder says about its pipeline."""

    pooling: Pooling | None  # None: no Pooling module
    max_seq_length: int | None


def read_sentence_transformers(folder: Path) -> SentenceTransformersConfig:
    """The pooling and length limit of a sentence-transformers folder (empty when it is not one)."""
    modules = _read_json(folder / "modules.json", default=[])
    if not isinstance(modules, list):
        raise InvalidCheckpoint(f"{folder / 'modules.json'}: not a list of modules")
    pooling, normalize = None, False
    for module in modules:
        kind = str(module.get("type", "")) if isinstance(module, dict) else ""
        name = kind.removeprefix(_ST_MODULE)
        if name == "Transformer":
            continue
        if name == "Normalize":
            normalize = True
        elif name == "Pooling":
            pooling = _pooling_mode(folder / str(module.get("path", "")) / "config.json")
        else:
            raise UnsupportedArchitecture(
                f"{folder.name}: sentence-transformers module {kind!r} is not supported"
            )
    limit = _read_json(folder / "sentence_bert_config.json", default={}).get("max_seq_length")
    return SentenceTransformersConfig(
        Pooling(pooling, normalize) if pooling else None, int(limit) if isinstance(limit, int) else None
    )


def _pooling_mode(path: Path) -> str:
    config = _read_json(path, default=None)
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{path}: missing or not a JSON object")
    chosen = [k for k, v in config.items() if k.startswith("pooling_mode_") and v is True]
    if len(chosen) != 1 or chosen[0] not in _ST_POOLING_KEYS:
        raise UnsupportedArchitecture(
            f"{path}: pooling {', '.join(chosen) or 'none'} is not supported (one of mean, CLS, last token)"
        )
    return _ST_POOLING_KEYS[chosen[0]]


def _read_json(path: Path, default: Any) -> Any:
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpoint(f"{path}: unreadable ({hf.one_line(e)})") from None


def is_embedding_model(spec: str, pooling: str | None = None) -> bool:
    """Whether ``spec`` is served for embeddings: an encoder, a sentence-transformers folder with a
    Pooling module, or any model when a ``pooling`` is named."""
    if pooling is not None:
        return True
    path = resolve(spec)
    if not path.is_dir() or not (path / "config.json").is_file():
        return False  # a GGUF file: a generation model unless a pooling is named
    if hf.read_config(path).get("model_type") in ENCODER_TYPES:
        return True
    return read_sentence_transformers(path).pooling is not None


class EmbeddingModel:
    """A loaded embedding model: tokenizer, limits and the batched forward."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        pooling: Pooling,
        max_tokens: int,
        dimension: int,
        is_encoder: bool,
        source: str,
        weight_policy: str = "",
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.pooling = pooling
        self.max_tokens = max_tokens
        self.dimension = dimension
        self.source = source
        self.weight_policy = weight_policy
        self.is_encoder = is_encoder
        # Matryoshka truncation (the OpenAI ``dimensions`` field) only where the model was trained for it:
        # the Qwen3-Embedding-style decoders are; sentence-transformers' BERT encoders are not.
        self.matryoshka = not self.is_encoder and pooling.normalize

    # ---- inputs ---------------------------------------------------------------------------------------
    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids of each text with the model's special tokens ([CLS] ... [SEP], or a final EOS)."""
        return [e.ids for e in self.tokenizer.backend.encode_batch(list(texts), add_special_tokens=True)]

    def check(self, inputs: Sequence[Sequence[int]], param: str = "input") -> None:
        """Refuse an empty input, ids outside the vocabulary, or more tokens than the model takes."""
        vocab = self.tokenizer.vocab_size
        for i, ids in enumerate(inputs):
            where = f"{param}[{i}]" if len(inputs) > 1 else param
            if not ids:
                raise InvalidRequest(f"{where} is empty", param=param)
            if len(ids) > self.max_tokens:
                raise ContextTooLong(
                    f"{where} has {len(ids)} tokens; this model takes at most {self.max_tokens}", param=param
                )
            if min(ids) < 0 or max(ids) >= vocab:
                raise InvalidRequest(f"{where}: token ids must lie in [0, {vocab})", param=param)

    def check_dimensions(self, dimensions: int | None) -> None:
        """Refuse a ``dimensions`` this model cannot give (before anything is computed)."""
        if dimensions is None or dimensions == self.dimension:
            return
        if dimensions > self.dimension:
            raise InvalidRequest(
                f"dimensions {dimensions} exceeds this model's {self.dimension}", param="dimensions"
            )
        if not self.matryoshka:
            raise InvalidRequest(
                f"this model's embeddings are not Matryoshka-trained: dimensions must be {self.dimension}",
                param="dimensions",
            )

    def resize(self, vectors: np.ndarray, dimensions: int | None) -> np.ndarray:
        """``vectors`` cut to their first ``dimensions`` (Matryoshka), renormalized if normalized."""
        self.check_dimensions(dimensions)
        if dimensions is None or dimensions == self.dimension:
            return vectors
        cut = vectors[:, :dimensions]
        return cut / np.maximum(np.linalg.norm(cut, axis=1, keepdims=True), 1e-12)

    # ---- forward ----------------------------------------------------------------------------------------
    def embed(
        self, inputs: Sequence[Sequence[int]], max_batch_tokens: int, max_batch_size: int
    ) -> np.ndarray:
        """float32 ``[len(inputs), dimension]``: inputs sorted by length, grouped into forwards of at
        most ``max_batch_size`` inputs and ``max_batch_tokens`` padded tokens (one input always fits)."""
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        out = np.empty((len(inputs), self.dimension), dtype=np.float32)
        start = 0
        while start < len(order):
            longest = len(inputs[order[start]])
            count = max(1, min(max_batch_size, max_batch_tokens // longest))
            rows = order[start : start + count]
            vectors = self.forward([inputs[i] for i in rows])
            mx.eval(vectors)
            out[rows] = np.asarray(vectors)
            start += count
        return out

    def forward(self, batch: Sequence[Sequence[int]]) -> mx.array:
        """Pooled (and normalized) float32 vectors ``[B, D]`` of one batch, lazy."""
        lengths = np.array([len(ids) for ids in batch], dtype=np.int32)
        hidden = (
            self._encoder_hidden(batch, lengths) if self.is_encoder else self._decoder_hidden(batch, lengths)
        )
        vectors = pool(hidden.astype(mx.float32), lengths, self.pooling.mode)
        if self.pooling.normalize:
            # torch.nn.functional.normalize's eps, as sentence-transformers' Normalize module uses it.
            vectors = vectors / mx.maximum(mx.linalg.norm(vectors, axis=-1, keepdims=True), 1e-12)
        return vectors

    def _encoder_hidden(self, batch: Sequence[Sequence[int]], lengths: np.ndarray) -> mx.array:
        ids = np.zeros((len(batch), int(lengths.max())), dtype=np.int32)
        for i, row in enumerate(batch):
            ids[i, : len(row)] = row
        mask = np.arange(ids.shape[1])[None, :] < lengths[:, None]
        return self.model(mx.array(ids), mx.array(mask))

    def _decoder_hidden(self, batch: Sequence[Sequence[int]], lengths: np.ndarray) -> mx.array:
        """Final-norm hidden states, padded to ``[B, L, D]`` from the ragged forward's ``[T, D]``."""
        bs = SCRATCH_BLOCK_SIZE
        slices, first_block = [], 0
        for n in lengths.tolist():
            blocks = -(-n // bs)
            slices.append(SequenceSlice(list(range(first_block, first_block + blocks)), 0, n))
            first_block += blocks
        meta = build_metadata(slices, bs)
        h = self.model.embed(mx.array(np.concatenate([np.asarray(ids, dtype=np.int32) for ids in batch])))
        # A pool as large as this forward's tokens, dropped with it: nothing is cached between requests.
        cache = new_cache(self.model, first_block, bs, h.dtype)
        for layer, kv in zip(self.model.layers, cache):
            h = layer(h, kv, meta)
        h = self.model.model.norm(h)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        col = np.arange(int(lengths.max()))[None, :]
        rows = starts[:, None] + np.minimum(col, lengths[:, None] - 1)  # padding repeats a real row
        return h[mx.array(rows.astype(np.int32))]


def pool(hidden: mx.array, lengths: np.ndarray, mode: str) -> mx.array:
    """One vector per row of a right-padded ``[B, L, D]`` batch whose rows hold ``lengths`` real tokens."""
    if mode == "cls":
        return hidden[:, 0]
    if mode == "last":
        return hidden[mx.arange(hidden.shape[0]), mx.array(lengths - 1)]
    mask = mx.array((np.arange(hidden.shape[1])[None, :] < lengths[:, None]).astype(np.float32))
    return (hidden * mask[:, :, None]).sum(axis=1) / mx.array(lengths.astype(np.float32))[:, None]


def load_embedding_model(
    spec: str, *, pooling: str | None = None, keep_quantized: bool | None = None
) -> EmbeddingModel:
    """Build and evaluate the embedding model of ``spec``; ``pooling`` overrides the checkpoint's."""
    if pooling is not None and pooling not in POOLING_MODES:
        raise InvalidRequest(f"pooling must be one of {', '.join(POOLING_MODES)}, not {pooling!r}")
    ckpt = open_checkpoint(spec)
    config = dict(ckpt.config)
    st = (
        read_sentence_transformers(ckpt.path)
        if ckpt.path.is_dir()
        else SentenceTransformersConfig(None, None)
    )
    model_type = config.get("model_type")
    encoder = model_type in ENCODER_TYPES
    if st.pooling is None and pooling is None and not encoder:
        raise InvalidRequest(
            f"{ckpt.path.name} is not an embedding model (no sentence-transformers pooling); name one "
            f"with --pooling ({', '.join(POOLING_MODES)})"
        )
    # Without a sentence-transformers config: mean pooling for an encoder (its default), unit vectors.
    mode = pooling or (st.pooling.mode if st.pooling else "mean")
    chosen = Pooling(mode, st.pooling.normalize if st.pooling else True)
    weights = ckpt.weights
    if encoder:
        module = encoder_module(model_type)
    else:
        module = None
        # The head is never used: tie it, so a checkpoint saved without one (sentence-transformers
        # saves the bare Qwen3Model: embed_tokens.weight, layers.N...) loads as it is.
        config["tie_word_embeddings"] = True
        weights = {k if k.startswith(("model.", "lm_head.")) else f"model.{k}": v for k, v in weights.items()}
    model = build_model(config, weights, ckpt.path.name, ckpt.kquants, module)
    ckpt.weights = {}
    policy = apply_weight_policy(model, keep_quantized, ckpt.requantize)
    try:
        mx.eval(model.parameters())
    except (RuntimeError, ValueError) as e:
        raise InvalidCheckpoint(f"{ckpt.path.name}: {hf.one_line(e)}") from None
    tokenizer = ckpt.tokenizer
    # Inputs are checked against the limit and refused, never cut short or padded by the tokenizer.
    tokenizer.backend.no_truncation()
    tokenizer.backend.no_padding()
    limits = [model.args.max_position_embeddings, st.max_seq_length or config.get("max_position_embeddings")]
    max_tokens = min(int(v) for v in limits if v)
    return EmbeddingModel(
        model, tokenizer, chosen, max_tokens, model.args.hidden_size, encoder, str(ckpt.path), policy
    )
