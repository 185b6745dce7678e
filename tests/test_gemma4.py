"""Gemma 4 beyond the logits test of test_architectures: KV sharing through the engine and its prefix
cache, what the pools and the planner count, and the config shapes of the published checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import CharTokenizer
from mlx.utils import tree_flatten, tree_map
from test_distributed import FakeGroup
from test_kernels import ATOL, attention_case, attention_error, needs_emulator

from mlx_infer.distributed import shard_pipeline, shard_tensor
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.runner import kv_bytes_per_token
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import SpeculativeConfig
from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.kv.pages import owned
from mlx_infer.loading import load, open_checkpoint
from mlx_infer.loading.build import build_model
from mlx_infer.models import gemma4
from mlx_infer.plan import make_plan
from mlx_infer.plan.weights import read_metadata
from mlx_infer.sampling import SamplingParams

TINY = Path(__file__).parent / "oracle" / "tiny"
# float32 pools and weights on both sides: the test_architectures tolerance, on log-probabilities.
TOL = 2e-4
# google/gemma-4-E2B-it's text_config (the values that shape the layers and their caches).
E2B = {
    "model_type": "gemma4_text", "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 35,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256, "global_head_dim": 512,
    "num_kv_shared_layers": 20, "hidden_size_per_layer_input": 256, "vocab_size": 262144,
    "vocab_size_per_layer_input": 262144, "use_double_wide_mlp": True, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7, "final_logit_softcapping": 30.0,
}  # fmt: skip


@pytest.fixture(scope="module")
def tiny():
    """The tiny gemma4_text checkpoint (layers 4 and 5 read layers 2 and 3) and transformers' logits."""
    folder = TINY / "gemma4_text"
    ref = np.load(folder / "reference.npz")
    return folder, ref["tokens_1"].tolist(), ref["logits_1"]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    return x - np.log(np.exp(x - x.max()).sum()) - x.max()


def make_engine(folder: Path, num_blocks: int = 96, budget: int = 64, speculate: bool = False) -> Engine:
    config = EngineConfig(
        block_size=4, num_blocks=num_blocks, enable_prefix_caching=True, kv_cache_dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=budget),
        speculative=SpeculativeConfig("ngram" if speculate else None, num_draft_tokens=4, max_batch=4),
    )  # fmt: skip
    return Engine(load(str(folder)).model, CharTokenizer(), 256, config)


def generate(engine: Engine, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id] += o.token_ids
    return [out[i] for i in ids]


def test_engine_prefix_cache_feeds_the_shared_layers(tiny):
    """A second request whose first 60 tokens are cached: the shared layers read, from blocks an
    earlier request's source layers wrote, what transformers computes over the whole prompt."""
    folder, tokens, want = tiny
    engine = make_engine(folder)
    # Six layers, four pools: the shared layers hold their sources' very objects.
    cache = engine.runner.cache
    assert len(cache) == 6 and len(owned(cache)) == 4
    assert cache[4] is cache[2] and cache[5] is cache[3]
    for n, cached in ((60, 0), (150, 60)):
        rid = engine.add_request(tokens[:n], SamplingParams(max_tokens=1, logprobs=5))
        outputs = []
        while engine.has_unfinished():
            outputs += [o for o in engine.step() if o.request_id == rid]
        assert outputs[-1].num_cached_tokens == cached
        (chosen,) = [lp for o in outputs for lp in (o.logprobs or [])]
        expected = log_softmax(want[n - 1])
        assert chosen.token_id == int(np.argmax(expected))
        got = dict(chosen.top)
        err = max(abs(lp - expected[t]) for t, lp in got.items())
        assert err <= TOL, f"prompt of {n}: max |logprob - transformers'| = {err:.2e}"


def test_preempted_batched_generation_equals_each_alone(tiny):
    """Three sequences in a pool too small for all: preempted ones are recomputed (sources and the
    layers reading them alike) and every answer equals the one generated alone."""
    folder, tokens, _ = tiny
    prompts = [tokens[:30], tokens[40:75], tokens[80:100]]
    alone = [generate(make_engine(folder), [p], 16)[0] for p in prompts]
    engine = make_engine(folder, num_blocks=14, budget=16)  # the longest alone needs 13 blocks
    assert generate(engine, prompts, 16) == alone
    assert engine.scheduler.num_preemptions > 0


def test_ngram_speculation_verifies_through_the_shared_layers(tiny):
    """Verification steps want every row's logits: greedy answers are the plain engine's, with
    proposals made and some accepted."""
    folder, tokens, _ = tiny
    prompts = [tokens[:30], tokens[80:100], tokens[:150]]
    plain = generate(make_engine(folder), prompts, 24)
    engine = make_engine(folder, speculate=True)
    assert generate(engine, prompts, 24) == plain
    assert engine.stats.spec_accepted > 0


def test_kv_bytes_count_only_pool_owning_layers(tiny):
    folder, _, _ = tiny
    model = load(str(folder)).model
    # Layers 0..3 own pools (two KV heads; 16 values in sliding layers, 32 in global ones); 4 and 5 none.
    owners = 2 * (2 * 16 + 2 * 32 + 2 * 16 + 2 * 32) * 4
    assert kv_bytes_per_token(model, mx.float32) == owners
    # The plan's bytes a token of context are the global layers'; the sliding ones have their own pool.
    plan = make_plan(str(folder), kv_cache_dtype="float32")
    assert plan.kv_bytes_per_token == 2 * (2 * 32 + 2 * 32) * 4
    assert plan.window_kv_bytes % (2 * (2 * 16 + 2 * 16) * 4) == 0 < plan.window_kv_bytes


@pytest.mark.parametrize("name", ["gemma4_text", "gemma4"])
def test_planned_weights_equal_what_load_holds(name):
    """The per-layer embedding table and projections, the double-wide MLPs and the experts are all
    counted: the plan's bytes are the loaded parameters' bytes."""
    folder = TINY / name
    held = sum(p.nbytes for _, p in tree_flatten(load(str(folder)).model.parameters()))
    assert make_plan(str(folder)).weights_bytes == held


def test_bfloat16_per_layer_table_stays_as_stored_on_the_cpu(tmp_path: Path):
    """A bfloat16 checkpoint on the CPU: every parameter is widened to float32 for the BLAS but the
    per-layer embedding table, which is only gathered (half its bytes kept); its rows are widened as
    they are read, so the logits are those of the checkpoint widened whole. The plan counts it so."""
    folder = tmp_path / "bf16"
    shutil.copytree(TINY / "gemma4_text", folder, ignore=shutil.ignore_patterns("*.gguf", "*.npz"))
    weights = {k: v.astype(mx.bfloat16) for k, v in mx.load(str(folder / "model.safetensors")).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "pt"})
    model = load(str(folder)).model
    params = dict(tree_flatten(model.parameters()))
    table = "model.embed_tokens_per_layer.weight"
    assert params[table].dtype == mx.bfloat16
    assert all(p.dtype == mx.float32 for k, p in params.items() if k != table)
    widened = build_model(json.loads((folder / "config.json").read_text()), weights, "bf16")
    widened.update(tree_map(lambda p: p.astype(mx.float32), widened.parameters()))
    tokens = mx.array(list(range(3, 40)))
    meta = build_metadata([SequenceSlice(list(range(10)), 0, 37, True)], 4)
    got = model(tokens, new_cache(model, 10, 4, mx.float32), meta)
    want = widened(tokens, new_cache(widened, 10, 4, mx.float32), meta)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-5, rtol=0)
    assert make_plan(str(folder)).weights_bytes == sum(p.nbytes for p in params.values())


def test_e2b_layers_caches_and_sources():
    """E2B's 35 layers: the last 20 read layer 13 (sliding) or 14 (global), as transformers'
    ``kv_sharing_modes`` picks them; global pools are 512 wide; only 15 layers own pools."""
    model = gemma4.Model(gemma4.ModelArgs.from_dict(E2B))
    layout = model.kv_layout()
    assert [s.source for s in layout[:15]] == [None] * 15
    assert [s.source for s in layout[15:]] == [14 if (i + 1) % 5 == 0 else 13 for i in range(15, 35)]
    assert {(s.n_kv_heads, s.head_dim) for s in layout[:15]} == {(1, 256), (1, 512)}
    assert layout[19] == gemma4.KVSpec(1, 512, 14)
    assert kv_bytes_per_token(model, mx.float16) == 2 * 2 * (12 * 256 + 3 * 512)
    # Shared layers carry no K/V projections; their MLPs are twice as wide.
    assert "k_proj" not in model.layers[20].self_attn and "k_proj" in model.layers[14].self_attn
    assert model.layers[20].mlp.gate_proj.weight.shape == (2 * 6144, 1536)
    assert model.layers[14].mlp.gate_proj.weight.shape == (6144, 1536)


def test_global_layers_from_per_layer_config_or_global_keys():
    """transformers 5 saves ``per_layer_config``; Google's configs give ``global_head_dim`` and, with
    keys as values, ``num_global_key_value_heads``."""
    base = {"num_hidden_layers": 2, "layer_types": ["sliding_attention", "full_attention"], "head_dim": 16}
    overrides = {"1": {"head_dim": 32, "num_key_value_heads": 1}}
    saved = gemma4.ModelArgs.from_dict({**base, "per_layer_config": overrides})
    assert [saved.layer_kv_shape(i) for i in range(2)] == [(4, 16), (1, 32)]
    k_eq_v = gemma4.ModelArgs.from_dict(
        {**base, "global_head_dim": 64, "attention_k_eq_v": True, "num_global_key_value_heads": 2}
    )
    assert [k_eq_v.layer_kv_shape(i) for i in range(2)] == [(4, 16), (2, 64)]
    # Without keys as values the global layers keep num_key_value_heads, as transformers does.
    plain = gemma4.ModelArgs.from_dict({**base, "global_head_dim": 64, "num_global_key_value_heads": 2})
    assert plain.layer_kv_shape(1) == (4, 64)


def test_decode_reads_a_row_of_the_per_layer_table_and_top_k_of_the_experts():
    """The planner's decode bound: the per-layer table is a lookup, and 2 of 4 experts run per token."""
    text = {t.name: t.read_fraction for t in read_metadata(str(TINY / "gemma4_text"), "cpu", None).tensors}
    assert text["model.embed_tokens_per_layer.weight"] == 0.0
    assert text["model.per_layer_model_projection.weight"] == 1.0
    moe = {t.name: t.read_fraction for t in read_metadata(str(TINY / "gemma4"), "cpu", None).tensors}
    assert moe["model.layers.0.experts.switch_glu.gate_proj.weight"] == 0.5
    assert moe["model.layers.0.mlp.gate_proj.weight"] == 1.0


def random_gemma4(**overrides) -> gemma4.Model:
    """Six layers, the last two reading layers 2 and 3, no per-layer inputs unless asked for."""
    config = {
        "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 6, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "global_head_dim": 32, "vocab_size": 128,
        "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"] * 3,
        "num_kv_shared_layers": 2, "hidden_size_per_layer_input": 0, **overrides,
    }  # fmt: skip
    mx.random.seed(0)
    model = gemma4.Model(gemma4.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    return model


def test_distributed_refuses_what_its_stages_and_shards_cannot_run():
    with pytest.raises(DistributedError, match="per-layer inputs"):
        shard_pipeline(random_gemma4(hidden_size_per_layer_input=8), FakeGroup(0, 2))
    # Even stages: layers 4 and 5 (second stage) read layer 2 and 3, the first stage's.
    with pytest.raises(DistributedError, match="layer 4 reads the K/V of layer 2"):
        shard_pipeline(random_gemma4(), FakeGroup(1, 2))


def test_tensor_ranks_keep_their_kv_heads_and_shared_layers_read_them():
    """Each rank's pools hold its half of the KV heads; a layer with a single KV head keeps it on both
    ranks (their query heads all read it); KV-shared layers still read their source's pools."""
    model = random_gemma4()
    shard_tensor(model, FakeGroup(1, 2))
    assert model.kv_layout() == [
        gemma4.KVSpec(1, 16, window=8), gemma4.KVSpec(1, 32), gemma4.KVSpec(1, 16, window=8),
        gemma4.KVSpec(1, 32), gemma4.KVSpec(1, 16, 2, window=8), gemma4.KVSpec(1, 32, 3),
    ]  # fmt: skip
    full, one = random_gemma4(num_key_value_heads=1), random_gemma4(num_key_value_heads=1)
    shard_tensor(one, FakeGroup(1, 2))
    assert one.kv_layout() == full.kv_layout()
    for layer, whole in zip(one.layers[:4], full.layers):
        np.testing.assert_array_equal(layer.self_attn.inner.k_proj.weight, whole.self_attn.k_proj.weight)
    with pytest.raises(DistributedError, match="divide by 4"):
        shard_tensor(random_gemma4(num_key_value_heads=2, num_attention_heads=6), FakeGroup(0, 4))


def test_a_pipeline_stage_keeps_a_shared_layer_with_its_source():
    """Stages of layers 0-1 and 2-5: the second holds both sources and both readers, its pools
    renumbered, and the two stages compute what one process does."""
    full, first, second = random_gemma4(), random_gemma4(), random_gemma4()
    shard_pipeline(first, FakeGroup(0, 2), [1, 2])
    shard_pipeline(second, FakeGroup(1, 2), [1, 2])
    assert second.kv_layout() == [
        gemma4.KVSpec(2, 16, window=8), gemma4.KVSpec(2, 32), gemma4.KVSpec(2, 16, 0, window=8),
        gemma4.KVSpec(2, 32, 1),
    ]  # fmt: skip
    tokens = mx.array(list(range(3, 40)))
    meta = build_metadata([SequenceSlice(list(range(10)), 0, 37)], 4)
    want = full(tokens, new_cache(full, 10, 4, mx.float32), meta)
    h = first.embed(tokens)
    for model in (first, second):
        for layer, kv in zip(model.layers, new_cache(model, 10, 4, mx.float32)):
            h = layer(h, kv, meta)
    np.testing.assert_allclose(np.array(first.logits(h, meta)), np.array(want), atol=1e-5, rtol=0)


def test_shared_layers_run_only_the_rows_whose_logits_are_wanted(tiny):
    """A ragged step of two prompt chunks (one after 40 cached tokens) and a decode row: past the
    first shared layer only each sequence's last row goes on, and its logits are transformers'."""
    folder, tokens, want = tiny
    model = load(str(folder)).model
    cache = new_cache(model, 128, 4, mx.float32)
    tables = [list(range(0, 40)), list(range(40, 80)), list(range(80, 120))]
    warm = [SequenceSlice(tables[0], 0, 40), SequenceSlice(tables[2], 0, 99)]
    model(mx.array(tokens[:40] + tokens[:99]), cache, build_metadata(warm, 4))
    step = [SequenceSlice(tables[0], 40, 110), SequenceSlice(tables[1], 0, 23)]
    meta = build_metadata([*step, SequenceSlice(tables[2], 99, 1)], 4)
    assert gemma4.last_rows_only(meta) is not None
    got = np.array(model(mx.array(tokens[40:150] + tokens[:23] + tokens[99:100]), cache, meta))
    np.testing.assert_allclose(got, want[[149, 22, 99]], atol=TOL, rtol=0)
    # A sequence wanting several rows (as verification does) beside a prompt chunk: every row goes on.
    cache = new_cache(model, 128, 4, mx.float32)
    model(mx.array(tokens[:40]), cache, build_metadata([SequenceSlice(tables[0], 0, 40)], 4))
    step = [SequenceSlice(tables[0], 40, 5, want_all_logits=True), SequenceSlice(tables[1], 0, 23)]
    meta = build_metadata(step, 4)
    assert gemma4.last_rows_only(meta) is None
    got = np.array(model(mx.array(tokens[40:45] + tokens[:23]), cache, meta))
    np.testing.assert_allclose(got, want[[40, 41, 42, 43, 44, 22]], atol=TOL, rtol=0)


@needs_emulator
@pytest.mark.parametrize("head_dim,dtype,window", [(512, mx.bfloat16, None), (256, mx.float32, 8)])
def test_metal_paged_attention_at_gemma4_head_sizes(head_dim, dtype, window):
    """The Metal kernel (run by the emulator) at E2B's global (512) and sliding (256) head sizes, eight
    query heads on one KV head, decode rows beside prefill chunks."""
    case = attention_case([20, 37, 9], [1, 5, 9], 8, 1, head_dim, dtype, seed=4)
    error, dtype = attention_error(*case, sliding_window=window)
    assert error < ATOL[dtype]


def test_shared_layers_unused_projections_in_a_checkpoint_are_dropped(tiny):
    """mlx-lm's conversions keep K/V projections (quantized: with scales and biases) and norms in the
    shared layers; they are never used, and the model loads and computes as without them."""
    folder, tokens, want = tiny
    ckpt = open_checkpoint(str(folder))
    weights = dict(ckpt.weights)
    for i in (4, 5):
        for name, shape in (("k_proj", (32, 64)), ("v_proj", (32, 64)), ("k_norm", (16,))):
            for part in ("weight", "scales", "biases"):
                weights[f"model.layers.{i}.self_attn.{name}.{part}"] = mx.ones(shape)
    model = build_model(ckpt.config, weights, "gemma4_text")
    meta = build_metadata([SequenceSlice(list(range(40)), 0, 150, True)], 4)
    got = np.array(model(mx.array(tokens), new_cache(model, 40, 4, mx.float32), meta))
    np.testing.assert_allclose(got, want, atol=TOL, rtol=0)
