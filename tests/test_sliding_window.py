"""Sliding-window layers keep only their window's blocks (kv/window.py), in a pool of their own.

The tiny random checkpoints of ``tests/oracle/tiny`` that mix sliding-window and global layers (window 8,
checked against transformers by test_architectures) run through the engine with blocks of 4 tokens:
greedy output equals an uncached full forward per token through chunked prefill, batching, preemption,
prefix caching and speculative verification, while the sliding layers' pool holds a few blocks per
sequence whatever its length.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from emulated import metal_kernels_emulated
from engine_helpers import CharTokenizer, greedy_reference
from test_hybrid import MAX_TOKENS, PROMPTS, make_engine, run_all, run_counting_cache

from mlx_infer.engine import runner
from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import SpeculativeConfig
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV, new_cache, window_of
from mlx_infer.kv import pages
from mlx_infer.kv.manager import KVCacheManager
from mlx_infer.loading import load
from mlx_infer.metal_kernels.emulator import toolchain_available
from mlx_infer.plan.planner import make_plan, window_pool_blocks
from mlx_infer.sampling import SamplingParams

TINY = Path(__file__).parent / "oracle" / "tiny"
BLOCK = 4
WINDOW = 8  # every tiny checkpoint's sliding_window
# A window of 8 reaches back into at most 3 blocks of 4 (positions p - 7 .. p), the last one partial.
DECODE_WINDOW_BLOCKS = 3


@pytest.fixture(scope="module", params=["gemma3_text", "gpt_oss", "gemma4_text"])
def windowed(request):
    model = load(str(TINY / request.param)).model
    assert window_of(model.kv_layout()) == WINDOW
    return request.param, model, [greedy_reference(model, p, MAX_TOKENS, eos=None) for p in PROMPTS]


@pytest.mark.parametrize(
    "num_blocks,budget,max_seqs",
    [(64, 512, 8), (30, 16, 4), (64, 7, 8), (64, 512, 1)],
    ids=["roomy", "preempting", "tiny-budget", "one-at-a-time"],
)
def test_engine_greedy_equals_full_recompute(windowed, num_blocks, budget, max_seqs):
    """Whatever the batching, chunking and preemption, the sliding layers read through their own block
    tables exactly what a full forward over the whole sequence reads; every block returns at the end."""
    _, model, references = windowed
    engine = make_engine(model, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs)
    assert engine.kv.window is not None
    window_layers = [c for c in engine.runner.cache if isinstance(c, LayerKV) and c.windowed]
    assert window_layers and all(c.num_blocks == engine.kv.window.pool.num_blocks for c in window_layers)
    assert run_all(engine, PROMPTS) == references
    if num_blocks == 30:
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0 and engine.kv.window.pool.num_used == 0
    check_block_accounting(engine)


def test_a_long_sequence_holds_only_its_window(windowed):
    """Decoding far past the window: the global layers hold a block per 4 tokens, the sliding ones the
    3 blocks their window reaches, the earlier ones back in their pool."""
    _, model, _ = windowed
    engine = make_engine(model, budget=16)
    held = []

    def watch(e: Engine) -> None:
        for r in e.scheduler.running:
            if r.num_computed > len(r.prompt_ids) + 1:  # decoding (the last step was one token)
                held.append(len(e.kv.window.held(r.request_id)))
                assert len(e.kv.block_tables[r.request_id]) * BLOCK >= r.num_computed  # every block

    params = SamplingParams(max_tokens=60, ignore_eos=True)
    engine.add_request(PROMPTS[2], params)
    while engine.has_unfinished():
        engine.step()
        watch(engine)
    assert held and max(held) <= DECODE_WINDOW_BLOCKS + 1  # + the block the next token opens
    check_block_accounting(engine)


def test_prefix_cache_needs_the_window_of_blocks_it_resumes_from(windowed):
    """A repeated prompt resumes from its cached blocks while the sliding layers' pool still holds the
    blocks its window reaches there; once other requests have taken those over, the hit shrinks to
    where the window is still cached (here: nothing), and the answer never changes."""
    _, model, references = windowed
    engine = make_engine(model, num_blocks=128, max_seqs=2)
    prompt = PROMPTS[2]  # 90 tokens: 22 full blocks before the last token
    assert run_counting_cache(engine, [prompt, prompt]) == ([references[2]] * 2, [0, 88])
    # Fill the sliding layers' pool with other sequences: the cached window blocks are reused.
    fillers = engine.kv.window.pool.num_blocks // 10
    others = [[(5 * i + j) % 50 + 3 for i in range(40)] for j in range(fillers)]
    run_all(engine, others)
    again, cached = run_counting_cache(engine, [prompt])
    assert again == [references[2]]
    assert cached[0] < 88 and cached[0] % BLOCK == 0
    check_block_accounting(engine)


def test_speculative_verification_trims_both_pools(windowed):
    """n-gram proposals verified and partly rejected: the answers are the plain engine's and both pools
    are whole again afterwards."""
    _, model, references = windowed
    engine = make_engine(model, speculative=SpeculativeConfig("ngram", num_draft_tokens=4, max_batch=8))
    assert run_all(engine, PROMPTS) == references
    assert engine.stats.spec_proposed > 0
    assert engine.kv.pool.num_used == 0 and engine.kv.window.pool.num_used == 0
    check_block_accounting(engine)


def test_windowed_pages_equal_shared_pages(windowed):
    """The forward itself: sliding layers paged by a window table whose early blocks were given back
    (None) compute the logits they compute over a table holding every block."""
    _, model, _ = windowed
    got, want = _windowed_and_shared_logits(model)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.skipif(not toolchain_available(), reason="the Metal emulator needs `pip install ziglang`")
def test_windowed_pages_through_the_emulated_metal_kernels():
    """As on a Mac: the paged-attention Metal kernel (run by the emulator) reads the windowed tables of
    gpt-oss's sliding layers (sinks too) as it reads the shared ones."""
    model = load(str(TINY / "gpt_oss")).model
    with metal_kernels_emulated() as launched:
        got, want = _windowed_and_shared_logits(model)
    assert any("paged_attention" in name for name in launched)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


def _windowed_and_shared_logits(model) -> tuple[np.ndarray, np.ndarray]:
    """Logits of 40 tokens in uneven chunks, the sliding layers paged by the window tables a manager
    hands out (blocks behind the window given back), and over shared pools holding every block."""
    tokens = PROMPTS[2][:40]
    manager = KVCacheManager(32, BLOCK, enable_prefix_caching=False, window=WINDOW, window_blocks=32)
    shared_cache = new_cache(model, 32, BLOCK, mx.float32)
    windowed_cache = new_cache(model, 32, BLOCK, mx.float32, window_blocks=32)
    got, want, done = [], [], 0
    for n in [13, 9, 1, 1, 7, 1, 8]:
        assert manager.allocate("s", tokens, done, n)
        table, window_table = manager.block_tables["s"], manager.window_table("s")
        step = mx.array(tokens[done : done + n])
        if done >= 2 * WINDOW:
            assert len(manager.window.held("s")) < len(window_table)  # the first blocks were given back
        want.append(model(step, shared_cache, build_metadata([SequenceSlice(table, done, n, True)], BLOCK)))
        meta = build_metadata([SequenceSlice(table, done, n, True, window_table=window_table)], BLOCK)
        got.append(model(step, windowed_cache, meta))
        done += n
    return np.concatenate(got), np.concatenate(want)


def test_allocation_equals_the_plan(windowed):
    """The pools the engine allocates are what the planner predicts: the global layers' per token of
    context, the sliding layers' a fixed pool for the windows of the running sequences."""
    name, model, _ = windowed
    seqs, context, bs = 2, 512, 16  # the tiny models' whole context
    plan = make_plan(str(TINY / name), context=context, max_num_seqs=seqs, kv_cache_dtype="float32")
    config = EngineConfig(
        block_size=bs, kv_cache_dtype="float32", kv_memory=plan.kv_bytes / 2**30,
        scheduler=SchedulerConfig(max_num_seqs=seqs),
    )  # fmt: skip
    engine = Engine(model, CharTokenizer(), 256, config)
    pools = {id(c): c for c in engine.runner.cache if isinstance(c, LayerKV)}.values()
    window_bytes = sum(a.nbytes for c in pools if c.windowed for a in c.state())
    main_bytes = sum(a.nbytes for c in pools if not c.windowed for a in c.state())
    # Two windows of 8 span 2 x (1 + 3) blocks of 16, and a 512-token step 32 more.
    assert engine.kv.window.pool.num_blocks == window_pool_blocks(WINDOW, bs, seqs, 512) == 40
    assert window_bytes == plan.window_kv_bytes > 0
    assert main_bytes == seqs * context * plan.kv_bytes_per_token == plan.kv_bytes - plan.window_kv_bytes


def test_idle_release_gives_back_both_pools(windowed, monkeypatch):
    """Idle, both pools unreserve their top chunks, forget their cached prefixes and give back their
    blocks' pages, each in its own layers' arrays."""
    _, model, references = windowed
    engine = make_engine(model, kv_chunk_tokens=16)  # chunks of 4 blocks, so the pools grew in use
    run_all(engine, PROMPTS)
    window_pool = engine.kv.window.pool
    assert window_pool.num_reserved_chunks > window_pool.min_chunks and window_pool.num_cached > 0
    dropped: list[tuple[bool, int]] = []

    def drop_blocks(cache, blocks, windowed=False):
        dropped.append((windowed, sum(len(r) for r in blocks)))
        return pages.drop_blocks(cache, blocks, windowed)

    monkeypatch.setattr(runner, "drop_blocks", drop_blocks)
    engine.release_idle_kv()
    assert window_pool.num_reserved_chunks == window_pool.min_chunks
    assert window_pool.num_cached == engine.kv.pool.num_cached == 0
    # Every reserved block of each pool, the windowed ones through the windowed layers' arrays.
    assert [w for w, _ in dropped] == [False, True] and all(n > 0 for _, n in dropped)
    assert run_all(engine, PROMPTS[:1]) == references[:1]  # and the engine runs on
