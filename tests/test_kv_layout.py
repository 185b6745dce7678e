"""Layers declare what they keep (``CausalLM.kv_layout``): pools, their sizing and the planner follow it."""

from __future__ import annotations

import mlx.core as mx

from mlx_infer.engine.runner import kv_bytes_per_token
from mlx_infer.interface.kv import KVSpec, new_cache
from mlx_infer.kv.pages import allocate_pools, drop_blocks, pages_droppable
from mlx_infer.plan.planner import layout_bytes_per_token


class SharingModel:
    """Four layers; the last two read the pools of layers 0 and 1 (as Gemma 4's shared layers do)."""

    layers = [None] * 4

    def kv_layout(self) -> list[KVSpec]:
        return [KVSpec(2, 8), KVSpec(1, 16), KVSpec(2, 8, source=0), KVSpec(1, 16, source=1)]


def test_a_sharing_layer_gets_its_sources_pools_and_owns_none():
    cache = new_cache(SharingModel(), 3, 4, mx.float16)
    assert cache[2] is cache[0] and cache[3] is cache[1] and cache[0] is not cache[1]
    assert cache[0].keys.shape == (12, 2, 8) and cache[1].keys.shape == (12, 1, 16)


def test_bytes_per_token_count_only_pool_owners():
    # Two owning layers of 16 values for K and for V, float16: 2 * 2 * 16 * 2 bytes.
    assert layout_bytes_per_token(SharingModel().kv_layout(), "float16") == 128
    assert kv_bytes_per_token(SharingModel(), mx.float16) == 128
    # int8 rows carry a float32 scale per head: layer 0 has 2 heads, layer 1 one.
    assert layout_bytes_per_token(SharingModel().kv_layout(), "int8") == 2 * (2 * 12 + 1 * 20)


def test_pools_are_allocated_and_dropped_once_per_owner():
    cache = allocate_pools(SharingModel(), 4096, 16, mx.float32)
    assert cache[2] is cache[0]
    cache[0].write(mx.ones((1, 2, 8)), mx.ones((1, 2, 8)), mx.array([5]))
    assert float(cache[2].keys[5].sum()) == 16.0  # the shared layer reads what its source wrote
    dropped = drop_blocks(cache, [range(0, 4096)])
    # Each pool once: two layers' K and V of 4096 * 16 slots x 16 floats, less partial pages at the ends.
    total = 4 * 4096 * 16 * 16 * 4
    assert 0.99 * total <= dropped <= total if pages_droppable() else dropped == 0
