"""GGUF MXFP4 tensors (llama.cpp's gpt-oss conversion) as MLX ``mxfp4`` packed words and scales.

A ggml MXFP4 block is 17 bytes for 32 values: one E8M0 exponent, then 16 bytes whose low nibbles hold
values 0..15 and high nibbles values 16..31 (as Q4_0 lays them out). MLX's ``mxfp4`` packs the same
4-bit E2M1 codes in order, eight a uint32 word with the lowest bits first, and keeps one uint8
exponent per 32 values: the codes are only re-ordered, never decoded, so the weights stay bit for bit
what the file holds.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

BLOCK_BYTES = 17  # 1 exponent + 16 bytes of codes
GROUP = 32


def mxfp4_from_gguf(raw: np.ndarray, shape: tuple[int, ...]) -> tuple[mx.array, mx.array]:
    """``raw`` (uint8, last axis ``shape[-1] / 32 * 17`` bytes) -> (uint32 ``[..., shape[-1] / 8]``, uint8
    ``[..., shape[-1] / 32]``), MLX's ``mxfp4`` weight and scales of a ``shape`` matrix (or stack)."""
    blocks = np.asarray(raw).reshape(*shape[:-1], shape[-1] // GROUP, BLOCK_BYTES)
    scales = np.ascontiguousarray(blocks[..., 0])
    qs = blocks[..., 1:]
    codes = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # [..., groups, 32] in value order
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)  # value 2j low, 2j + 1 high
    words = np.ascontiguousarray(packed).reshape(*shape[:-1], -1).view(np.uint32)
    return mx.array(words), mx.array(scales)
