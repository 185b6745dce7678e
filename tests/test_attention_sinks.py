"""Attention sinks (gpt-oss): a learned logit per query head in every softmax's denominator.

Each paged-attention path (the pure-MLX reference, the native CPU kernel, the Metal kernel run by the
emulator, single pass and split-KV) against one dense NumPy oracle, over float32, float16 and int8
pools, with and without a sliding window. The oracle reads the rows the pool holds (int8 rows
dequantized by their scales), so what is compared is the attention, not the pool's rounding.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from test_kernels import EMU, needs_emulator

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import pool_rows, split_int8_rows
from mlx_infer.metal_kernels import paged_attention as pa
from mlx_infer.metal_kernels import reference

BLOCK = 16
N_HEADS, N_KV, HEAD_DIM = 6, 2, 64
# (tokens already cached, new tokens): decodes at contexts 1, 15 and 300, a prefill chunk after 20.
SHAPES = [(0, 1), (14, 1), (299, 1), (20, 5)]
# Above and below the scores (which spread over a few units): a sink of 9 takes most of its head's
# weight, one of -30 none.
SINKS = np.array([-2.0, 0.5, 3.0, 9.0, -30.0, 1.0], dtype=np.float32)
POOLS = [mx.float32, mx.float16, mx.int8]


def step(seed: int):
    rng = np.random.default_rng(seed)
    needed = [-(-(c + n) // BLOCK) for c, n in SHAPES]
    physical = rng.permutation(sum(needed) + 2)
    starts = np.cumsum([0] + needed)
    tables = [physical[a:b].tolist() for a, b in zip(starts[:-1], starts[1:])]
    meta = build_metadata([SequenceSlice(t, c, n) for t, (c, n) in zip(tables, SHAPES)], BLOCK)
    pool = (len(physical) * BLOCK, N_KV, HEAD_DIM)
    keys, values = (mx.array(rng.standard_normal(pool).astype(np.float32)) for _ in range(2))
    q = mx.array(rng.standard_normal((sum(n for _, n in SHAPES), N_HEADS, HEAD_DIM)).astype(np.float32))
    return q, keys, values, tables, meta


def as_read(pool: mx.array) -> np.ndarray:
    """The float64 values a pool's rows hold."""
    if pool.dtype != mx.int8:
        return np.array(pool.astype(mx.float32), dtype=np.float64)
    q, scales = split_int8_rows(pool)
    return np.array(q.astype(mx.float32), dtype=np.float64) * np.array(scales, dtype=np.float64)[..., None]


def dense_oracle(q, key_pool, value_pool, tables, meta, scale, window, sinks, softcap=None) -> np.ndarray:
    """softmax([scores, sink]) without the sink's column, times the values, one query at a time (the
    scores soft-capped first when ``softcap``)."""
    q, keys, values = np.array(q, dtype=np.float64), as_read(key_pool), as_read(value_pool)
    seq_of = np.repeat(np.arange(len(SHAPES)), [n for _, n in SHAPES])
    rep = N_HEADS // N_KV
    out = np.zeros_like(q)
    for t, pos in enumerate(np.array(meta.positions)):
        seq = seq_of[t]
        lo = 0 if window is None else max(0, pos - window + 1)
        js = np.arange(lo, pos + 1)
        slots = np.array(tables[seq])[js // BLOCK] * BLOCK + js % BLOCK
        for h in range(N_HEADS):
            scores = keys[slots, h // rep] @ q[t, h] * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            logits = np.append(scores, sinks[h])
            p = np.exp(logits - logits.max())
            out[t, h] = (p[:-1] / p.sum()) @ values[slots, h // rep]
    return out


def attend(path: str, q, kp, vp, meta, scale, window, sinks, softcap=None) -> mx.array:
    if path == "reference":
        return reference.paged_attention(q, kp, vp, meta, scale, window, softcap, sinks)
    if path == "cpu":
        assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
        return cpu_kernels.paged_attention(q, kp, vp, meta, scale, window, softcap, sinks)
    parts = 64 if path == "metal-split" else None  # 300 keys -> 5 partitions, the reduce adds the sink
    return pa.paged_attention(
        q, kp, vp, meta, scale, window, softcap, sinks, launch=EMU, partition_keys=parts
    )


PATHS = ["reference", "cpu", pytest.param("metal", marks=needs_emulator),
         pytest.param("metal-split", marks=needs_emulator)]


@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("dtype", POOLS, ids=["float32", "float16", "int8"])
@pytest.mark.parametrize("path", PATHS)
def test_attention_with_sinks_equals_dense_softmax(path, dtype, window):
    q, keys, values, tables, meta = step(seed=POOLS.index(dtype) + (window or 0))
    kp, vp = pool_rows(keys, dtype), pool_rows(values, dtype)
    scale = HEAD_DIM**-0.5
    out = attend(path, q, kp, vp, meta, scale, window, mx.array(SINKS))
    want = dense_oracle(q, kp, vp, tables, meta, scale, window, SINKS)
    np.testing.assert_allclose(np.array(out), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("path", PATHS)
def test_sinks_with_soft_capped_scores(path):
    """Soft-capping (Gemma's) and sinks together: the reference's own soft-capped path included."""
    q, keys, values, tables, meta = step(seed=11)
    scale = HEAD_DIM**-0.5
    out = attend(path, q, keys, values, meta, scale, 7, mx.array(SINKS), softcap=2.0)
    want = dense_oracle(q, keys, values, tables, meta, scale, 7, SINKS, softcap=2.0)
    np.testing.assert_allclose(np.array(out), want, rtol=0, atol=2e-5)


@pytest.mark.parametrize("path", PATHS)
def test_sinks_change_the_output(path):
    """The oracle above without its sinks is far from every path's output: a path that dropped the
    sinks would fail there."""
    q, keys, values, tables, meta = step(seed=0)
    scale = HEAD_DIM**-0.5
    out = np.array(attend(path, q, keys, values, meta, scale, None, mx.array(SINKS)))
    without = dense_oracle(q, keys, values, tables, meta, scale, None, np.full(N_HEADS, -np.inf))
    assert np.abs(out[:, 3] - without[:, 3]).max() > 0.1  # the head whose sink is 9
    np.testing.assert_allclose(out[:, 4], without[:, 4], atol=2e-5)  # a sink of -30 weighs nothing
