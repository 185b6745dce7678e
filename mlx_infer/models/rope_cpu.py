"""RoPE for the CPU backend: the cos/sin tables once per step, then one fused kernel per call.

On the CPU backend ``mx.fast.rope`` has no kernel: MLX expands it into its reference graph (about 30
ops, cos/sin recomputed from the positions) at every call, twice per layer. Here the tables of a step's
positions are built once (:class:`StepMemo` keyed by the positions array every layer passes) with the
same operations as MLX's reference, so results are bit-for-bit equal, and the rotation is one op of the
native CPU kernels (``cpu_kernels.rope``, same arithmetic in the same order) or, without them, one
compiled elementwise kernel plus the slices and the concatenation around it.
"""

from __future__ import annotations

import math
from functools import cache, partial

import mlx.core as mx

from mlx_infer import cpu_kernels
from mlx_infer.interface.step_memo import StepMemo

_tables = StepMemo()


@partial(mx.compile, shapeless=True)
def _rotate(x1: mx.array, x2: mx.array, cos: mx.array, sin: mx.array) -> tuple[mx.array, mx.array]:
    return x1 * cos - x2 * sin, x1 * sin + x2 * cos


@cache
def _inverse_frequencies(dims: int, base: float) -> mx.array:
    """``base ** (-2i / dims)`` as MLX's reference RoPE computes it, once per model (not in every step's
    graph: four ops)."""
    half = dims // 2
    inv_freqs = mx.exp(mx.arange(0, -half, -1, dtype=mx.float32) * (math.log(base) / half))
    mx.eval(inv_freqs)
    return inv_freqs


def _cos_sin(
    positions: mx.array, dims: int, base: float, scale: float, freqs: mx.array | None, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """``[T, 1, dims/2]`` cos and sin of each position, as MLX's reference RoPE computes them."""
    inv_freqs = _inverse_frequencies(dims, base) if freqs is None else mx.reciprocal(freqs.astype(mx.float32))
    theta = (positions.astype(mx.float32) * scale)[:, None, None] * inv_freqs
    return mx.cos(theta).astype(dtype), mx.sin(theta).astype(dtype)


def step_tables(
    positions: mx.array, dims: int, base: float, scale: float, freqs: mx.array | None, dtype: mx.Dtype
) -> tuple[mx.array, mx.array]:
    """The step's cos/sin tables (``[T, 1, dims/2]``), built by the first layer that asks for them."""
    key = (dims, base, scale, id(freqs), dtype)
    # freqs is a model attribute, alive as long as the model: its id is a stable key within a step.
    return _tables.get(positions, key, lambda: _cos_sin(positions, dims, base, scale, freqs, dtype))


def apply_rope_cpu(
    x: mx.array, positions: mx.array, dims: int, base: float, scale: float, freqs: mx.array | None
) -> mx.array:
    """Non-traditional (half-split) RoPE of ``x`` ([T, H, D]) at ``positions`` ([T])."""
    cos, sin = step_tables(positions, dims, base, scale, freqs, x.dtype)
    native = cpu_kernels.rope(x, cos, sin, dims)
    if native is not None:
        return native
    half = dims // 2
    parts = list(_rotate(x[..., :half], x[..., half:dims], cos, sin))
    if dims < x.shape[-1]:
        parts.append(x[..., dims:])
    return mx.concatenate(parts, axis=-1)
