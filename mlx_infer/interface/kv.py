"""Per-layer caches as layers and kernels see them: what a layer declares it keeps (:class:`KVSpec`)
and the pools that hold it (:class:`LayerKV`, :class:`LatentKV`), the int8 row format, and
:func:`new_cache`, which builds one entry per layer from ``model.kv_layout()``.

Models, kernels, the engine and convert import this module; it imports nothing of theirs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_infer import cpu_kernels
from mlx_infer.interface.state import LayerState, StateSpec

INT8_SCALE_BYTES = 4  # an int8 pool row ends with its float32 scale


@dataclass(frozen=True)
class KVSpec:
    """What one layer keeps per token: K and V pools of ``n_kv_heads x head_dim`` of its own, or, with
    ``source``, none: it attends over layer ``source``'s pools (Gemma 4's KV sharing), writing nothing.
    ``window``: a sliding-window layer attends to its last ``window`` positions only, so the engine keeps
    just those positions' blocks for it (``kv/window.py``)."""

    n_kv_heads: int
    head_dim: int
    source: int | None = None
    # No V pool: the layer reads its values out of its key rows (MLA's latent rows, :class:`LatentKV`).
    values_in_keys: bool = False
    window: int | None = None

    @property
    def owns_pool(self) -> bool:
        return self.source is None


class LayerKV:
    """The K and V pools of one attention layer.

    Stored flat as ``[num_blocks * block_size, n_kv_heads, head_dim]``: the same memory as the
    ``[num_blocks, block_size, n_kv_heads, head_dim]`` layout the kernels index, and the shape
    MLX's scatter writes in place when the pool is donated (no other reference alive).

    ``dtype`` is the pool's (the KV cache dtype): float32, float16 or bfloat16 rows, or ``mx.int8``:
    each (token, KV head) row quantized symmetrically with one float32 scale (``max|x| / 127``) stored
    right after its ``head_dim`` values, so the pools are ``[slots, n_kv_heads, head_dim + 4]`` int8
    and a slot stays one contiguous run (see :func:`quantize_rows`, ``cpu_kernels/src/kv_format.h``).

    ``windowed``: the pool belongs to the sliding-window layers' own block pool, so it is paged by the
    batch's windowed block tables (``BatchMetadata.pages``), not the full-attention layers' ones.
    """

    windowed = False

    def __init__(self, num_blocks: int, block_size: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype):
        self.block_size = block_size
        self.head_dim = head_dim
        row = head_dim + INT8_SCALE_BYTES if dtype == mx.int8 else head_dim
        self.keys = mx.zeros((num_blocks * block_size, n_kv_heads, row), dtype=dtype)
        self.values = mx.zeros((num_blocks * block_size, n_kv_heads, row), dtype=dtype)

    @property
    def num_blocks(self) -> int:
        return self.keys.shape[0] // self.block_size

    def write(self, keys: mx.array, values: mx.array, slot_mapping: mx.array) -> None:
        """Scatter this step's ``[T, n_kv_heads, head_dim]`` keys/values into their slots (rounded to
        the pool's dtype, or quantized into an int8 pool).

        Rebinding ``self.keys`` drops the last reference to the old pool, so the lazy scatter may
        reuse (donate) its buffer instead of copying the whole pool every step; the native write (CPU
        backend) writes in place always, the pools being the engine's memory.
        """
        k, v = self.keys, self.values
        self.keys = self.values = None  # type: ignore[assignment]
        native_k = cpu_kernels.kv_write(k, keys, slot_mapping, in_place=True)
        if native_k is not None:  # one op per pool instead of four (CPU backend)
            self.keys, self.values = native_k, cpu_kernels.kv_write(v, values, slot_mapping, in_place=True)
            return
        k[slot_mapping] = pool_rows(keys, k.dtype)
        v[slot_mapping] = pool_rows(values, v.dtype)
        self.keys, self.values = k, v

    def state(self) -> list[mx.array]:
        return [self.keys, self.values]


class LatentKV(LayerKV):
    """A multi-head latent attention layer's pool (``models/mla.py``): ``[slots, 1, row]`` rows and no
    value pool, the values being a prefix of each row, so ``values`` is the key pool itself."""

    def __init__(self, num_blocks: int, block_size: int, head_dim: int, dtype: mx.Dtype):
        self.block_size = block_size
        self.head_dim = head_dim
        row = head_dim + INT8_SCALE_BYTES if dtype == mx.int8 else head_dim
        self.keys = mx.zeros((num_blocks * block_size, 1, row), dtype=dtype)

    @property
    def values(self) -> mx.array:  # type: ignore[override]
        return self.keys

    def write(self, keys: mx.array, values: mx.array | None, slot_mapping: mx.array) -> None:
        """Scatter this step's ``[T, 1, row]`` rows (``values`` must be None: they are in the rows).

        Rebinding ``self.keys`` drops the last reference to the old pool, so the scatter may donate it.
        """
        assert values is None, "a latent layer's values are a prefix of its rows"
        pool = self.keys
        self.keys = None  # type: ignore[assignment]
        native = cpu_kernels.kv_write(pool, keys, slot_mapping, in_place=True)
        if native is not None:
            self.keys = native
            return
        pool[slot_mapping] = pool_rows(keys, pool.dtype)
        self.keys = pool

    def state(self) -> list[mx.array]:
        return [self.keys]


def new_cache(
    model: Any,
    num_blocks: int,
    block_size: int,
    dtype: mx.Dtype,
    num_state_slots: int = 1,
    window_blocks: int | None = None,
) -> list[LayerKV | LayerState]:
    """One entry per layer of ``model.kv_layout()``, unevaluated: a pool-owning layer's own
    :class:`LayerKV` (:class:`LatentKV` for MLA), a sharing layer the very object of its source, a
    recurrent layer (``StateSpec``) its :class:`LayerState` of ``num_state_slots`` slots.

    ``window_blocks``: the sliding-window layers' pools get this many blocks of their own and are
    marked ``windowed`` (None: every pool has ``num_blocks`` and is paged by the one block table)."""
    cache: list[LayerKV | LayerState] = []
    for spec in model.kv_layout():
        if isinstance(spec, StateSpec):
            cache.append(LayerState(num_state_slots, spec))
        elif not spec.owns_pool:
            cache.append(cache[spec.source])
        else:
            windowed = window_blocks is not None and spec.window is not None
            blocks = window_blocks if windowed else num_blocks
            if spec.values_in_keys:
                layer = LatentKV(blocks, block_size, spec.head_dim, dtype)
            else:
                layer = LayerKV(blocks, block_size, spec.n_kv_heads, spec.head_dim, dtype)
            layer.windowed = windowed
            cache.append(layer)
    return cache


def window_of(layout: list) -> int | None:
    """The attention window of ``layout``'s sliding-window layers (the widest, if they differ) when the
    layout mixes them with full-attention layers, else None: with no full-attention layer to keep the
    whole context, every block stays (see ``kv/window.py``)."""
    pools = [s for s in layout if isinstance(s, KVSpec) and s.owns_pool]
    windows = [s.window for s in pools if s.window is not None]
    return max(windows) if windows and len(windows) < len(pools) else None


def pool_rows(x: mx.array, dtype: mx.Dtype) -> mx.array:
    """``[T, n_kv, D]`` keys or values as a pool of ``dtype`` stores them."""
    return quantize_rows(x) if dtype == mx.int8 else x.astype(dtype)


def quantize_rows(x: mx.array) -> mx.array:
    """``[..., D]`` values -> ``[..., D + 4]`` int8: each row symmetric, ``q = round(x / scale)`` with
    ``scale = max|x| / 127`` (ties to even, as the native write), then the scale's four bytes. An
    all-zero row gets scale 0 and zeros."""
    x = x.astype(mx.float32)
    scale = mx.abs(x).max(axis=-1, keepdims=True) / 127.0
    q = mx.where(scale > 0, x / mx.where(scale > 0, scale, 1.0), 0.0)
    q = mx.clip(mx.round(q), -127, 127).astype(mx.int8)
    return mx.concatenate([q, scale.view(mx.int8)], axis=-1)


def split_int8_rows(rows: mx.array) -> tuple[mx.array, mx.array]:
    """``[..., D + 4]`` int8 rows -> (``[..., D]`` int8 values, ``[...]`` float32 scales)."""
    return rows[..., :-INT8_SCALE_BYTES], rows[..., -INT8_SCALE_BYTES:].view(mx.float32)[..., 0]
