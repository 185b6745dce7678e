"""What every architecture shares: the attention entry point, RoPE and the :class:`CausalLM` skeleton
(the batch metadata and per-layer caches they take are in ``mlx_infer/interface/``).

Models run on a *flattened ragged batch*: ``tokens`` is ``[T]`` (all scheduled tokens of all
sequences, one after the other) and every attention layer calls :func:`attention` with the
step's :class:`BatchMetadata`. Models know nothing about paging: :func:`attention` writes the new
K/V into the layer's pool and attends over the block tables, through the kernel dispatch in
``mlx_infer.metal_kernels``.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import KVSpec, LayerKV
from mlx_infer.models.rope_config import scaling_type
from mlx_infer.models.rope_cpu import apply_rope_cpu


@dataclass
class BaseModelArgs:
    """Base of every ``ModelArgs``: builds itself from a Hugging Face ``config.json`` dict,
    ignoring keys the architecture does not use."""

    @classmethod
    def from_dict(cls, params: dict[str, Any]):
        names = inspect.signature(cls).parameters
        return cls(**{k: v for k, v in params.items() if k in names})


def attention(
    queries: mx.array,
    keys: mx.array,
    values: mx.array,
    kv: LayerKV,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: mx.array | None = None,
) -> mx.array:
    """Write ``keys``/``values`` ([T, n_kv_heads, D]) into ``kv`` and attend ``queries`` ([T, H, D]).

    ``sinks`` ([H], gpt-oss): a learned logit per query head that joins every softmax's denominator
    without a value, so a head may attend to nothing. Returns ``[T, H, D]``. The one attention entry
    point of every model.
    """
    from mlx_infer.metal_kernels import dispatch

    meta = meta.pages(kv.windowed)
    kv.write(keys, values, meta.slot_mapping)
    return dispatch.paged_attention(
        queries, kv.keys, kv.values, meta, scale, sliding_window, logit_softcap, sinks
    )


def rope_frequencies(
    head_dim: int,
    base: float,
    scaling: dict[str, Any] | None = None,
    rotary_dim: int | None = None,
    max_position_embeddings: int | None = None,
) -> mx.array | None:
    """Per-pair periods (``1 / inv_freq``) for ``mx.fast.rope``'s ``freqs`` argument, or None for plain
    RoPE.

    Implements ``rope_type`` ``llama3`` and ``yarn`` (with :func:`rope_attention_factor`); ``linear``
    scaling is handled by the caller through ``scale``.
    """
    kind = scaling_type(scaling)
    dims = rotary_dim or head_dim
    if kind == "yarn":
        return _yarn_frequencies(dims, base, scaling, max_position_embeddings)
    if kind != "llama3":
        return None
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    freqs = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    wavelens = 2 * mx.pi * freqs
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    freqs = mx.where(wavelens > low_wavelen, freqs * factor, freqs)
    smooth = (old_ctx / wavelens - low) / (high - low)
    smoothed = freqs / ((1 - smooth) / factor + smooth)
    is_medium = (wavelens > high_wavelen) & (wavelens < low_wavelen)
    return mx.where(is_medium, smoothed, freqs)


def _yarn_factor(scaling: dict[str, Any], max_position_embeddings: int | None) -> tuple[float, int]:
    """(factor, original context) as transformers reads them: DeepSeek-style configs give no factor and
    let max/original context stand for it."""
    original = scaling.get("original_max_position_embeddings") or max_position_embeddings
    if original is None:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    factor = scaling.get("factor") or (max_position_embeddings or original) / original
    return float(factor), int(original)


def _yarn_frequencies(
    dims: int, base: float, scaling: dict[str, Any], max_position_embeddings: int | None
) -> mx.array:
    """YaRN (arXiv 2309.00071): high-frequency pairs keep their period (extrapolation), low-frequency
    ones are stretched by ``factor`` (interpolation), with a linear ramp between the pair indices where
    ``beta_fast`` and ``beta_slow`` rotations fit in the original context."""
    factor, original = _yarn_factor(scaling, max_position_embeddings)
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def pair_for(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = pair_for(beta_fast), pair_for(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001  # as transformers: no division by zero
    # float32 throughout, as transformers computes it, so the periods agree to the last bit or two.
    ramp = mx.clip((mx.arange(dims // 2, dtype=mx.float32) - low) / (high - low), 0.0, 1.0)
    periods = base ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims)
    inv_freq = (1.0 / (factor * periods)) * ramp + (1.0 / periods) * (1.0 - ramp)
    return 1.0 / inv_freq


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's Eq. 21: ``0.1 * mscale * ln(factor) + 1`` (1 when not stretched)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_attention_factor(
    scaling: dict[str, Any] | None, max_position_embeddings: int | None = None
) -> float:
    """What the rotated dimensions of q and k are multiplied by (transformers' ``attention_factor``,
    applied to cos and sin): YaRN's mscale; 1 for every other scaling."""
    if scaling_type(scaling) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, _ = _yarn_factor(scaling, max_position_embeddings)
    mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and mscale_all_dim:
        return yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
    return yarn_mscale(factor)


def rope_scale(scaling: dict[str, Any] | None) -> float:
    if scaling_type(scaling) == "linear":
        return 1.0 / scaling["factor"]
    return 1.0


def apply_rope(
    x: mx.array,
    positions: mx.array,
    dims: int,
    base: float,
    traditional: bool,
    scale: float,
    freqs: mx.array | None,
    attention_factor: float = 1.0,
) -> mx.array:
    """RoPE on ``[T, H, D]`` at per-token ``positions`` ([T]); the first ``dims`` dimensions (the
    rotated ones) are then multiplied by ``attention_factor`` (see :func:`rope_attention_factor`)."""
    if not traditional and mx.default_device() == mx.cpu:
        # mx.fast.rope has no CPU kernel; this computes the same values with far fewer ops per layer.
        y = apply_rope_cpu(x, positions, dims, base, scale, freqs)
    else:
        # mx.fast.rope rotates along the second-to-last axis with one offset per leading-axis row:
        # [T, H, 1, D] makes each token a sequence of length one starting at its own position.
        y = mx.fast.rope(
            x[:, :, None],
            dims,
            traditional=traditional,
            base=None if freqs is not None else base,
            scale=scale,
            offset=positions,
            freqs=freqs,
        )[:, :, 0]
    if attention_factor == 1.0:
        return y
    if dims == y.shape[-1]:
        return y * attention_factor
    return mx.concatenate([y[..., :dims] * attention_factor, y[..., dims:]], axis=-1)


def select_rows(h: mx.array, meta: BatchMetadata) -> mx.array:
    """The rows of ``h`` ([T, D]) whose logits the step needs."""
    return h if meta.logits_index is None else h[meta.logits_index]


class CausalLM(nn.Module):
    """What every architecture's ``Model`` shares: embedding -> blocks -> final norm -> head.

    Subclasses build ``self.model`` (with ``embed_tokens``, ``layers``, ``norm``) and, for untied
    heads, ``self.lm_head``; they override ``embed``/``logits``/``sanitize`` where they differ.
    """

    # Parameters only ever read a row at a time (a gather, never a matrix product): the CPU weight policy
    # keeps them in their stored dtype rather than widening them to float32 for the BLAS, which would
    # double their memory for nothing; the model widens the rows it reads.
    row_tables: tuple[str, ...] = ()

    def __init__(self, args):
        super().__init__()
        self.args = args
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def embed(self, tokens: mx.array) -> mx.array:
        return self.model.embed_tokens(tokens)

    def head(self, h: mx.array) -> mx.array:
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(h)
        return self.lm_head(h)

    def logits(self, h: mx.array, meta: BatchMetadata) -> mx.array:
        return self.head(self.model.norm(select_rows(h, meta)))

    def __call__(self, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata) -> mx.array:
        return self.logits(*self.hidden(tokens, cache, meta))

    def hidden(
        self, tokens: mx.array, cache: list[LayerKV], meta: BatchMetadata
    ) -> tuple[mx.array, BatchMetadata]:
        """The last block's output and the metadata whose ``logits_index`` picks its logit rows: the
        forward without the head, which a tensor-parallel follower runs (it samples nothing)."""
        h = self.embed(tokens)
        # CPU kernels: blocks that are all native run as one op (models/native_block.py's NativeStack).
        stack = self.__dict__.get("native_stack")
        if stack is not None and (out := stack(h, self.layers, cache, meta)) is not None:
            return out, meta
        for layer, kv in zip(self.layers, cache):
            h = layer(h, kv, meta)
        return h, meta

    @property
    def layers(self) -> list[nn.Module]:
        return self.model.layers

    def kv_shape(self) -> tuple[int, int]:
        """(n_kv_heads, head_dim) of every attention layer's cache."""
        return self.args.num_key_value_heads, self.args.head_dim

    def kv_layout(self) -> list[KVSpec]:
        """What each layer keeps (see :class:`KVSpec`); the KV pools, their sizing and the memory
        planner follow it. Architectures whose layers differ in shape override it; a layer's window is
        its attention module's ``sliding_window``."""
        shape = self.kv_shape()
        windows = [getattr(layer.self_attn, "sliding_window", None) for layer in self.layers]
        return [KVSpec(*shape, window=window) for window in windows]

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        weights = {k: v for k, v in weights.items() if "rotary_emb.inv_freq" not in k}
        if self.args.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        return weights
