"""GGUF K-quant blocks that MLX's affine format cannot express, dequantized with MLX ops.

Layouts follow llama.cpp (``dequantize_row_q4_K`` / ``_q5_K`` / ``_q6_K``); each row of a
weight is its raw bytes ``[rows, blocks * block_bytes]`` (uint8), as the ``gguf`` reader returns
them. This is the reference (and the fallback off Metal) for the K-quant matvec kernel.
"""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.errors import InvalidCheckpoint

QK_K = 256
BLOCK_BYTES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}


def _f16(lo: mx.array, hi: mx.array) -> mx.array:
    bits = lo.astype(mx.uint16) | (hi.astype(mx.uint16) << 8)
    return bits.view(mx.float16).astype(mx.float32)


def _blocks(raw: mx.array, kind: str) -> mx.array:
    size = BLOCK_BYTES[kind]
    if raw.dtype != mx.uint8 or raw.ndim != 2 or raw.shape[1] % size:
        message = f"{kind} weight must be uint8 [rows, k * {size}], got {raw.dtype} {raw.shape}"
        raise InvalidCheckpoint(message)
    return raw.reshape(raw.shape[0], raw.shape[1] // size, size)


def _scales_mins(b: mx.array) -> tuple[mx.array, mx.array]:
    """Q4_K/Q5_K: float32 ``[rows, blocks, 8]`` scales and mins of the 8 sub-blocks of 32 values.

    Each sub-block has a 6-bit scale and a 6-bit min, packed in the 12 bytes after ``d`` and ``dmin``.
    """
    d, dmin = _f16(b[..., 0], b[..., 1]), _f16(b[..., 2], b[..., 3])
    sc = b[..., 4:16]
    low_scale, low_min = sc[..., 0:4] & 63, sc[..., 4:8] & 63
    high_scale = (sc[..., 8:12] & 15) | ((sc[..., 0:4] >> 6) << 4)
    high_min = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    scale = mx.concatenate([low_scale, high_scale], axis=-1).astype(mx.float32) * d[..., None]
    mins = mx.concatenate([low_min, high_min], axis=-1).astype(mx.float32) * dmin[..., None]
    return scale, mins


def _nibbles(qs: mx.array) -> mx.array:
    """``[rows, blocks, 128]`` bytes -> ``[rows, blocks, 8, 32]`` 4-bit values: 4 chunks of 32 bytes,
    each giving a sub-block of low nibbles, then one of high nibbles."""
    chunks = qs.reshape(*qs.shape[:2], 4, 32)
    return mx.stack([chunks & 15, chunks >> 4], axis=3).reshape(*qs.shape[:2], 8, 32)


def dequantize_q4_k(raw: mx.array) -> mx.array:
    """``[rows, blocks * 144]`` bytes -> float32 ``[rows, blocks * 256]``."""
    b = _blocks(raw, "Q4_K").astype(mx.uint32)
    scale, mins = _scales_mins(b)
    q = _nibbles(b[..., 16:144]).astype(mx.float32)
    values = q * scale[..., None] - mins[..., None]
    return values.reshape(raw.shape[0], -1)


def dequantize_q5_k(raw: mx.array) -> mx.array:
    """``[rows, blocks * 176]`` bytes -> float32 ``[rows, blocks * 256]``.

    Q4_K's scales, mins and nibbles, plus a fifth bit: bit j of ``qh[l]`` (bytes 16..47) is the high
    bit of value l of sub-block j.
    """
    b = _blocks(raw, "Q5_K").astype(mx.uint32)
    scale, mins = _scales_mins(b)
    high = (b[..., None, 16:48] >> mx.arange(8, dtype=mx.uint32)[:, None]) & 1  # [rows, blocks, 8, 32]
    q = (_nibbles(b[..., 48:176]) | (high << 4)).astype(mx.float32)
    values = q * scale[..., None] - mins[..., None]
    return values.reshape(raw.shape[0], -1)


def dequantize_q6_k(raw: mx.array) -> mx.array:
    """``[rows, blocks * 210]`` bytes -> float32 ``[rows, blocks * 256]``."""
    b = _blocks(raw, "Q6_K").astype(mx.int32)
    lead = b.shape[:2]
    ql = b[..., 0:128].reshape(*lead, 2, 64)
    qh = b[..., 128:192].reshape(*lead, 2, 32)
    scales = b[..., 192:208]
    scales = mx.where(scales > 127, scales - 256, scales).astype(mx.float32).reshape(*lead, 2, 8)
    d = _f16(b[..., 208], b[..., 209])
    q1 = (ql[..., 0:32] & 15) | ((qh & 3) << 4)
    q2 = (ql[..., 32:64] & 15) | (((qh >> 2) & 3) << 4)
    q3 = (ql[..., 0:32] >> 4) | (((qh >> 4) & 3) << 4)
    q4 = (ql[..., 32:64] >> 4) | (((qh >> 6) & 3) << 4)
    q = (mx.stack([q1, q2, q3, q4], axis=3) - 32).astype(mx.float32)  # [rows, blocks, 2, 4, 32]
    # Within each half, 16-value groups take scales[is], is = l // 16, plus 2 per quarter.
    scale = scales.reshape(*lead, 2, 4, 2)[..., None]  # [.., half, quarter, l // 16, 1]
    values = q.reshape(*lead, 2, 4, 2, 16) * scale * d[..., None, None, None, None]
    return values.reshape(raw.shape[0], -1)


DEQUANTIZE = {"Q4_K": dequantize_q4_k, "Q5_K": dequantize_q5_k, "Q6_K": dequantize_q6_k}


def gguf_matmul(x: mx.array, raw: mx.array, kind: str, bias: mx.array | None = None) -> mx.array:
    """``x @ dequantize(raw).T (+ bias)`` in float32, cast to ``x.dtype``."""
    out = x.astype(mx.float32) @ DEQUANTIZE[kind](raw).T
    if bias is not None:
        out = out + bias.astype(mx.float32)
    return out.astype(x.dtype)
