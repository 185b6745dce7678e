"""gpt-oss specifics beyond the logits test of test_architectures.py (which covers both tiny folders:
float experts, and MXFP4 experts against transformers' dequantizing loader)."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from emulated import metal_kernels_emulated
from test_kernels import needs_emulator

from mlx_infer.errors import InvalidCheckpoint
from mlx_infer.loading import hf, load
from mlx_infer.loading.build import build_model
from mlx_infer.models.qwen3_moe import QuantizedSwitchLinear

TINY = Path(__file__).parent / "oracle" / "tiny"
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def test_mxfp4_experts_load_as_mlx_mxfp4_without_dequantizing():
    loaded = load(str(TINY / "gpt_oss_mxfp4"))
    experts = loaded.model.model.layers[1].mlp.experts
    raw = hf.read_weights(TINY / "gpt_oss_mxfp4")
    blocks = np.array(raw["model.layers.1.mlp.experts.gate_up_proj_blocks"])
    scales = np.array(raw["model.layers.1.mlp.experts.gate_up_proj_scales"]).astype(np.int32)
    # The checkpoint's values, decoded with NumPy: [E, 2I, in], gate and up rows interleaved.
    values = np.stack([FP4[blocks & 15], FP4[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], 32)
    values = (values * 2.0 ** (scales - 127)[..., None]).reshape(*blocks.shape[:2], -1)
    for name, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
        layer = experts[name]
        assert isinstance(layer, QuantizedSwitchLinear) and layer.mode == "mxfp4"
        assert layer.weight.dtype == mx.uint32 and layer.scales.dtype == mx.uint8
        w = mx.dequantize(layer.weight, layer.scales, None, group_size=32, bits=4, mode="mxfp4")
        np.testing.assert_array_equal(np.array(w.astype(mx.float32)), values[:, rows])
    assert "mxfp4 MoE experts kept" in loaded.weight_policy


def test_blocks_that_are_not_mxfp4_are_an_invalid_checkpoint():
    folder = TINY / "gpt_oss_mxfp4"
    weights = hf.read_weights(folder)
    name = "model.layers.0.mlp.experts.down_proj_blocks"
    weights[name] = weights[name].reshape(*weights[name].shape[:2], -1)  # [E, out, in / 2]: no 16-byte blocks
    with pytest.raises(InvalidCheckpoint, match="not MXFP4 blocks"):
        build_model(hf.read_config(folder), weights, folder.name)


def test_tensor_parallel_shards_sum_to_the_whole_model():
    """Two tensor-parallel shards (each rank's heads with their sinks, its slice of every expert), their
    attention and MoE outputs summed as the all_sum would: the unsharded logits."""
    from test_distributed import FakeGroup

    from mlx_infer.distributed import shard_tensor
    from mlx_infer.interface.batch import SequenceSlice, build_metadata
    from mlx_infer.interface.kv import new_cache

    folder = str(TINY / "gpt_oss")
    whole = load(folder).model
    shards = [load(folder).model for _ in range(2)]
    for rank, model in enumerate(shards):
        shard_tensor(model, FakeGroup(rank, 2))
    tokens = mx.array(np.arange(3, 40) % 128, dtype=mx.int32)
    meta = build_metadata([SequenceSlice(list(range(10)), 0, len(tokens))], 4)
    expected = whole(tokens, new_cache(whole, 10, 4, mx.float32), meta)

    caches = [new_cache(m, 10, 4, mx.float32) for m in shards]
    h = shards[0].embed(tokens)
    for i, block in enumerate(shards[0].layers):
        parts = [m.layers[i] for m in shards]
        normed = block.input_layernorm(h)
        h = h + sum(p.self_attn.inner(normed, cache[i], meta) for p, cache in zip(parts, caches))
        normed = block.post_attention_layernorm(h)
        h = h + sum(p.mlp.inner(normed) for p in parts)
    got = shards[0].logits(h, meta)
    assert shards[0].layers[0].self_attn.inner.sinks.shape == (2,)
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5, rtol=0)


@pytest.mark.parametrize("keep_quantized", [None, False, True])
def test_planned_weights_equal_what_load_holds(keep_quantized):
    """The memory plan counts MXFP4 experts as the 4.25 bits a value they stay at under every weight
    policy (serve's fit check would otherwise refuse gpt-oss-20b as 84 GB of float32)."""
    from mlx.utils import tree_flatten

    from mlx_infer.plan.planner import make_plan

    for name in ("gpt_oss", "gpt_oss_mxfp4"):
        loaded = load(str(TINY / name), keep_quantized=keep_quantized)
        held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        plan = make_plan(str(TINY / name), keep_quantized=keep_quantized, backend="cpu")
        assert plan.weights_bytes == held, name


@pytest.fixture
def emulated_kernels():
    """The dispatch bound to the Metal kernels, launched by the emulator; yields the kernels' names."""
    with metal_kernels_emulated() as launched:
        yield launched


@needs_emulator
def test_the_metal_kernels_give_transformers_logits(emulated_kernels):
    """The whole model through the kernel dispatch as on a Mac (the Metal attention kernel with sinks, run
    by the emulator): the long prompt's logits, chunked then decoded, equal transformers' as on the CPU."""
    from test_architectures import TOL, block_table, forward, new_cache

    from mlx_infer.interface.batch import SequenceSlice

    model = load(str(TINY / "gpt_oss_mxfp4")).model
    ref = np.load(TINY / "gpt_oss_mxfp4" / "reference.npz")
    tokens, want = ref["tokens_1"][:40], ref["logits_1"][:40]
    table, cache, rows, done = block_table(0, len(tokens)), new_cache(model), [], 0
    for n in (30, 9, 1):  # a chunk past the window of 8, a second one, a decode step
        rows.append(forward(model, cache, [SequenceSlice(table, done, n, True)], tokens[done : done + n]))
        done += n
    assert np.abs(np.concatenate(rows) - want).max() <= TOL
    assert "paged_attention_sinks" in emulated_kernels
