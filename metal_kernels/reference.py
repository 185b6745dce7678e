"""Pure-MLX reference implementations: the fallback off Metal and the oracle for the kernels."""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.interface.batch import BatchMetadata
from mlx_infer.interface.kv import split_int8_rows
from mlx_infer.interface.step_memo import StepMemo

_step = StepMemo()  # per-step mask and gather rows, shared by every layer


def attention_mask(meta: BatchMetadata, key_len: int, sliding_window: int | None) -> mx.array:
    """Boolean ``[B, 1, Qmax, L]``: key j is visible to a query at position p when j <= p,
    j < context_len, and (with a window) j > p - window."""
    key_pos = mx.arange(key_len, dtype=mx.int32)[None, None, :]
    q_pos = meta.q_positions[:, :, None]
    visible = (key_pos <= q_pos) & (key_pos < meta.context_lens[:, None, None])
    if sliding_window is not None:
        visible = visible & (key_pos > q_pos - sliding_window)
    return visible[:, None]


def paged_attention(
    queries: mx.array,
    key_pool: mx.array,
    value_pool: mx.array,
    meta: BatchMetadata,
    scale: float,
    sliding_window: int | None = None,
    logit_softcap: float | None = None,
    sinks: mx.array | None = None,
    value_dim: int | None = None,
) -> mx.array:
    """Attention of ragged queries ``[T, H, D]`` over paged K/V pools ``[slots, n_kv_heads, D]``
    (or int8 pools ``[slots, n_kv_heads, D + 4]``, see ``models/base.py: LayerKV``). With
    ``value_dim`` the values are the first ``value_dim`` of each value row, and the output
    ``[T, H, value_dim]`` (multi-head latent attention reads them out of the key pool itself).

    Gathers each sequence's keys by its block table into ``[B, n_kv, L, D]``, pads the queries
    to ``[B, Qmax]``, attends with a causal/context/window mask and unpads. Masked positions
    never contribute, so padding slots may hold anything. ``sinks`` ([H]): a logit per query head added
    to every softmax's denominator (a key with no value). Pools of another dtype than the queries
    are attended in float32: int8 rows are dequantized after the gather (only the rows the step
    reads, never the whole pool), half rows widened, so a float32 query loses nothing more than
    what the pool's rounding already lost.
    """
    n_tokens, n_heads, head_dim = queries.shape
    batch = meta.batch_size
    q_max = meta.max_query_len
    if q_max == 1:
        # Decode: one query per sequence, [B, 1, H, D] and [B, H, 1, D] are the same memory.
        q = queries.reshape(batch, n_heads, 1, head_dim)
    else:
        q = queries if meta.q_pad_index is None else queries[meta.q_pad_index.reshape(-1)]
        q = q.reshape(batch, q_max, n_heads, head_dim).transpose(0, 2, 1, 3)
    keys = _gather_heads_first(key_pool, meta)
    values = keys if value_pool is key_pool else _gather_heads_first(value_pool, meta)
    out_dtype = q.dtype
    if key_pool.dtype != q.dtype:
        same = values is keys
        q, keys = q.astype(mx.float32), _widen(keys)
        values = keys if same else _widen(values)
    if value_dim is not None:
        values = values[..., :value_dim]
    out_dim = values.shape[-1]
    # Every layer of a step (of the same window) shares one mask: built once, not once per layer.
    key_len = keys.shape[2]
    mask = _step.get(meta, (key_len, sliding_window), lambda: attention_mask(meta, key_len, sliding_window))
    if logit_softcap is None:
        out = mx.fast.scaled_dot_product_attention(
            q, keys.astype(q.dtype), values.astype(q.dtype), scale=scale, mask=mask,
            sinks=None if sinks is None else sinks.astype(q.dtype),
        )
    else:
        out = _softcapped_attention(q, keys, values, mask, scale, logit_softcap, sinks)
    out = out.astype(out_dtype)
    if q_max == 1:
        return out.reshape(batch, n_heads, out_dim)
    out = out.transpose(0, 2, 1, 3).reshape(batch * q_max, n_heads, out_dim)
    return out if meta.q_unpad_index is None else out[meta.q_unpad_index]


def _widen(rows: mx.array) -> mx.array:
    """Gathered pool rows as float32: int8 ones ``[..., D + 4]`` dequantized by their scales."""
    if rows.dtype != mx.int8:
        return rows.astype(mx.float32)
    q, scales = split_int8_rows(rows)
    return q.astype(mx.float32) * scales[..., None]


def _gather_heads_first(pool: mx.array, meta: BatchMetadata) -> mx.array:
    """``[B, n_kv, L, D]`` keys (or values) of each sequence, gathered straight into the layout the
    attention matmuls read, so no transposed copy follows: row ``slot * n_kv + head`` of the pool
    viewed as ``[slots * n_kv, row]`` (``row``: D, or D + 4 for int8 pools)."""
    n_kv, head_dim = pool.shape[1], pool.shape[2]

    def rows() -> mx.array:
        heads = mx.arange(n_kv, dtype=mx.int32)[None, :, None]
        return meta.key_slots[:, None, :] * n_kv + heads

    return pool.reshape(-1, head_dim)[_step.get(meta, ("rows", n_kv), rows)]


def _softcapped_attention(
    q: mx.array, keys: mx.array, values: mx.array, mask: mx.array, scale: float, softcap: float,
    sinks: mx.array | None = None,
) -> mx.array:
    batch, n_heads, q_len, head_dim = q.shape
    n_kv = keys.shape[1]
    rep = n_heads // n_kv
    q = q.reshape(batch, n_kv, rep * q_len, head_dim).astype(mx.float32)
    scores = (q * scale) @ keys.astype(mx.float32).swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    scores = scores.reshape(batch, n_kv, rep, q_len, -1)
    scores = mx.where(mask[:, :, None], scores, -mx.inf)
    if sinks is not None:  # one more column per head, dropped after the softmax (it has no value)
        sink = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, n_kv, rep, 1, 1), (*scores.shape[:-1], 1))
        scores = mx.concatenate([scores, sink], axis=-1)
    weights = mx.softmax(scores, axis=-1)
    if sinks is not None:
        weights = weights[..., :-1]
    weights = weights.reshape(batch, n_kv, rep * q_len, -1)
    out = weights @ values.astype(mx.float32)
    return out.reshape(batch, n_heads, q_len, values.shape[-1]).astype(values.dtype)


def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    group_size: int,
    bits: int,
    bias: mx.array | None = None,
    residual: mx.array | None = None,
) -> mx.array:
    """``x @ dequantize(w).T (+ bias) (+ residual)`` for MLX affine-quantized ``w``, in float32.

    MLX's CPU ``quantized_matmul`` accumulates in the activation dtype, so the oracle dequantizes
    and multiplies in float32 and casts once at the end.
    """
    weight = mx.dequantize(w, scales, biases, group_size=group_size, bits=bits).astype(mx.float32)
    out = x.astype(mx.float32) @ weight.T
    if bias is not None:
        out = out + bias.astype(mx.float32)
    if residual is not None:
        out = out + residual.astype(mx.float32)
    return out.astype(x.dtype)
