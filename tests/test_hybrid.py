"""Hybrid models (Gated DeltaNet + attention) in the engine: recurrent state slots beside the KV blocks.

The tiny random checkpoints of ``tests/oracle/tiny`` (already checked against transformers by
test_architectures) run through the engine: greedy output equals an uncached full forward per token,
through chunked prefill, batching, slot reuse, and preemption with recomputation.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from emulated import metal_kernels_emulated
from engine_helpers import CharTokenizer, greedy_reference
from test_distributed import FakeGroup

from distributed import shard_tensor
from mlx_infer import cpu_kernels
from mlx_infer.convert import cli as convert_cli
from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import SpeculativeConfig
from mlx_infer.errors import DistributedError, UnsupportedArchitecture
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV, new_cache
from mlx_infer.interface.state import LayerState, StateSpec, continuing
from mlx_infer.loading import load
from mlx_infer.metal_kernels import dispatch
from mlx_infer.metal_kernels import gated_delta as metal_gated_delta
from mlx_infer.metal_kernels.emulator import Emulator, toolchain_available
from mlx_infer.models.gated_delta import (
    Ragged,
    chunk_gated_delta,
    decode_step,
    recurrent_gated_delta,
    sequences_step,
)
from mlx_infer.plan.planner import make_plan
from mlx_infer.sampling import SamplingParams

TINY = Path(__file__).parent / "oracle" / "tiny"
# One prompt longer than a DeltaNet chunk (64), so prefill runs the chunked form across chunks.
PROMPTS = [list(range(5, 23)), [3, 4, 5], [(7 * i) % 60 + 3 for i in range(90)], [9] * 20]
MAX_TOKENS = 12


@pytest.fixture(scope="module", params=["qwen3_5_moe_text", "qwen3_next"])
def hybrid(request):
    model = load(str(TINY / request.param)).model
    return model, [greedy_reference(model, p, MAX_TOKENS, eos=None) for p in PROMPTS]


def make_engine(model, num_blocks=64, budget=512, max_seqs=8, **config) -> Engine:
    config = EngineConfig(
        block_size=4,
        num_blocks=num_blocks,
        kv_cache_dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
        **config,
    )
    return Engine(model, CharTokenizer(), 256, config)


def run_all(engine: Engine, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
    return [tokens[i] for i in ids]


@pytest.mark.parametrize(
    "num_blocks,budget,max_seqs",
    [(64, 512, 8), (30, 16, 4), (64, 7, 8), (64, 512, 1)],
    ids=["roomy", "preempting", "tiny-budget", "one-at-a-time"],
)
def test_engine_greedy_equals_full_recompute(hybrid, num_blocks, budget, max_seqs):
    """Batched, chunked (the tiny budget cuts prompts into uneven chunks) and preempted runs all give the
    tokens of a full forward over the whole sequence at every step; with one sequence at a time, every
    request reuses slot 0 after the one before it."""
    model, references = hybrid
    engine = make_engine(model, num_blocks=num_blocks, budget=budget, max_seqs=max_seqs)
    assert run_all(engine, PROMPTS) == references
    if num_blocks == 30:
        # 30 blocks of 4 cannot hold the four sequences (45 blocks): someone was preempted and recomputed.
        assert engine.scheduler.num_preemptions > 0
    assert engine.kv.pool.num_used == 0 and engine.kv.state_slots.num_used == 0
    check_block_accounting(engine)


def test_prefix_cache_resumes_from_saved_states(hybrid, caplog):
    """A prompt that extends an earlier sequence (the next chat turn), or repeats an earlier prompt,
    starts from the recurrent state saved at the last block boundary both share: cached tokens are
    reported, and the tokens equal a full recompute."""
    model, references = hybrid
    with caplog.at_level(logging.INFO, logger="mlx_infer"):
        engine = make_engine(model)
    assert "prefix caching up to block boundaries where a state was saved" in caplog.text
    prompt = PROMPTS[2]  # 90 tokens: its prefill ends at 88 (a boundary), then 2 more
    first = run_all(engine, [prompt])[0]
    assert first == references[2]
    # The first sequence computed 90 + 11 tokens: states saved at 88 and at every boundary of its decode.
    turn = prompt + first + [7, 8, 9, 10, 11]
    again, cached = run_counting_cache(engine, [prompt, turn])
    assert again == [references[2], greedy_reference(model, turn, MAX_TOKENS, eos=None)]
    assert cached == [88, 100]
    assert engine.kv.pool.num_used == 0 and engine.kv.state_slots.num_used == 0
    check_block_accounting(engine)


def run_counting_cache(engine: Engine, prompts) -> tuple[list[list[int]], list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs, cached = [], []
    for p in prompts:  # one after the other, so the second can find the first's states
        request_id = engine.add_request(p, params)
        tokens = []
        while engine.has_unfinished():
            for out in engine.step():
                tokens.extend(out.token_ids)
                if out.finished:
                    cached.append(out.num_cached_tokens)
        outputs.append(tokens)
        assert request_id not in engine.kv.block_tables
    return outputs, cached


def test_without_prefix_caching_nothing_is_saved(hybrid):
    model, references = hybrid
    engine = make_engine(model, enable_prefix_caching=False)
    assert engine.kv.checkpoints is None
    assert run_counting_cache(engine, [PROMPTS[2], PROMPTS[2]]) == ([references[2]] * 2, [0, 0])


def test_speculative_decoding_is_refused(hybrid):
    model, _ = hybrid
    with pytest.raises(UnsupportedArchitecture, match="recurrent state"):
        make_engine(model, speculative=SpeculativeConfig(method="ngram"))


def test_kv_and_state_allocation_equal_the_plan(hybrid):
    """The pools and state slots the engine allocates, and the states it may save for prefix caching,
    are what the planner predicts, and they come out of the same budget as the blocks."""
    model, _ = hybrid
    folder = str(TINY / model.args.model_type)
    seqs = 3
    plan = make_plan(folder, context=256, max_num_seqs=seqs, kv_cache_dtype="float32")
    engine = make_engine(model, num_blocks=None, max_seqs=seqs, kv_memory=plan.kv_bytes / 2**30)
    cache = engine.runner.cache
    kv_bytes = sum(a.nbytes for c in cache if isinstance(c, LayerKV) for a in c.state())
    state_bytes = sum(a.nbytes for c in cache if isinstance(c, LayerState) for a in c.state())
    num_tokens = engine.kv.pool.num_blocks * engine.config.block_size
    assert kv_bytes == num_tokens * plan.kv_bytes_per_token
    # Slots are allocated up front; the saved states (as many) as prefixes are cached, within the budget.
    assert engine.state_bytes == plan.state_bytes == 2 * state_bytes > 0
    assert engine.kv.checkpoints.capacity == engine.kv.num_state_slots == seqs
    block_bytes = engine.config.block_size * plan.kv_bytes_per_token
    assert engine.kv.pool.num_blocks == (plan.kv_bytes - plan.state_bytes) // block_bytes


def _random_delta_inputs(batch: int, length: int, heads: int = 4, dk: int = 16, dv: int = 8):
    rng = np.random.default_rng(0)

    def normal(*shape):
        return mx.array(rng.standard_normal(shape).astype(np.float32))

    q, k = normal(batch, length, heads, dk), normal(batch, length, heads, dk)
    q = q / mx.linalg.norm(q, axis=-1, keepdims=True) * dk**-0.5
    k = k / mx.linalg.norm(k, axis=-1, keepdims=True)
    g = -mx.abs(normal(batch, length, heads)) * 0.3
    beta = mx.sigmoid(normal(batch, length, heads))
    return q, k, normal(batch, length, heads, dv), g, beta, normal(batch, heads, dk, dv)


def test_chunked_form_equals_token_by_token_recurrence():
    """150 tokens (three 64-token chunks, the last one padded) from a nonzero state: the chunked prefill
    form and the decode step form give the same outputs and final state."""
    q, k, v, g, beta, state = _random_delta_inputs(2, 150)
    out, final = chunk_gated_delta(q, k, v, g, beta, state)
    s, steps = state, []
    for t in range(150):
        o, s = recurrent_gated_delta(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], s)
        steps.append(o)
    np.testing.assert_allclose(np.array(out), np.array(mx.stack(steps, axis=1)), atol=1e-4)
    np.testing.assert_allclose(np.array(final), np.array(s), atol=1e-4)


def test_padded_rows_leave_the_state_alone():
    """A ragged batch pads shorter sequences: rows with no decay and no write change nothing."""
    q, k, v, g, beta, state = _random_delta_inputs(1, 100)
    out, final = chunk_gated_delta(q[:, :70], k[:, :70], v[:, :70], g[:, :70], beta[:, :70], state)
    keep = (mx.arange(100) < 70).astype(mx.float32)[None, :, None]
    padded_out, padded_final = chunk_gated_delta(q, k, v, g * keep, beta * keep, state)
    np.testing.assert_allclose(np.array(padded_out[:, :70]), np.array(out), atol=1e-5)
    np.testing.assert_allclose(np.array(padded_final), np.array(final), atol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5_text"])
def test_tensor_ranks_split_a_delta_net_into_partial_sums_over_their_heads_state(name: str):
    """Each rank's Gated DeltaNet (its key heads and their value heads: Qwen3-Next's interleaved
    projections, Qwen3.5's separate ones) over slots of half the state gives a partial output, and the
    two add up to the whole layer's, through a prefill and a decode step. (Whole models on two ranks:
    test_distributed.)"""
    full = load(str(TINY / name)).model
    x = mx.random.normal((10, full.args.hidden_size), key=mx.random.key(0))
    steps = [build_metadata([SequenceSlice([0, 1, 2], 0, 9, state_slot=1)], 4),
             build_metadata([SequenceSlice([0, 1, 2], 9, 1, state_slot=1)], 4)]  # fmt: skip

    def run(model) -> list[mx.array]:
        net, spec = model.layers[0].linear_attn, model.kv_layout()[0]
        state = LayerState(2, spec)
        return [getattr(net, "inner", net)(x[m.positions], state, m) for m in steps]

    want = run(full)
    parts = []
    for rank in range(2):
        model = load(str(TINY / name)).model
        shard_tensor(model, FakeGroup(rank, 2))
        assert model.kv_layout()[0].bytes_per_slot() * 2 == full.kv_layout()[0].bytes_per_slot()
        parts.append(run(model))
    for a, b, w in zip(*parts, want):
        np.testing.assert_allclose(np.array(a + b), np.array(w), atol=1e-5, rtol=0)
    with pytest.raises(DistributedError, match=r"key heads \(2\) to divide by 4"):
        shard_tensor(load(str(TINY / name)).model, FakeGroup(0, 4))


# (heads, Dk, Dv): the tiny checkpoints' shapes, and Qwen3.5's 128 x 128 state matrices
DECODE_SHAPES = [(4, 16, 8), (2, 128, 128)]


def _decode_step_case(heads: int, dk: int, dv: int):
    """A decode step's inputs: states in scattered slots of a larger pool (each head's matrix and its
    output row), one sequence starting from zeros (keep 0) over a slot holding garbage."""
    q, k, v, g, beta, _ = _random_delta_inputs(3, 1, heads, dk, dv)
    pool = mx.random.normal((6, 1, heads * (dk + 1) * dv), key=mx.random.key(1))
    slots, keep = mx.array([4, 0, 2]), mx.array([1.0, 0.0, 1.0])
    return q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], pool, slots, keep


def _decode(monkeypatch, q, k, v, g, beta, pool, slots, keep, native: bool) -> tuple[np.ndarray, np.ndarray]:
    """(outputs, the pool afterwards) of ``decode_step`` with the native kernel or the MLX reference."""
    heads, dk, dv = q.shape[1], q.shape[2], v.shape[2]
    state = LayerState(pool.shape[0], StateSpec(((heads, dk + 1, dv),)))
    state.arrays[0] = mx.array(pool)
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(cpu_kernels, "gated_delta", lambda *args: None)
        out = decode_step(q, k, v, g, beta, state, 0, slots, keep)
        return np.array(out), np.array(state.arrays[0]).reshape(pool.shape[0], heads, dk + 1, dv)


@pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_native_decode_step_equals_the_reference(monkeypatch, shape):
    """In place in the slots it reads; the other slots are left as they were."""
    case = _decode_step_case(*shape)
    out, pool = _decode(monkeypatch, *case, native=True)
    want_out, want_pool = _decode(monkeypatch, *case, native=False)
    np.testing.assert_allclose(out, want_out, atol=1e-4)
    np.testing.assert_allclose(pool, want_pool, atol=1e-4)
    untouched = [1, 3, 5]
    before = np.array(case[5]).reshape(pool.shape)
    np.testing.assert_array_equal(pool[untouched], before[untouched])


@pytest.mark.skipif(not toolchain_available(), reason="the Metal emulator needs `pip install ziglang`")
@pytest.mark.parametrize("shape", DECODE_SHAPES)
def test_metal_decode_step_equals_the_reference(monkeypatch, shape):
    """The Metal kernel body, run by the emulator (out-of-bounds and unwritten outputs are faults)."""
    q, k, v, g, beta, pool, slots, keep = case = _decode_step_case(*shape)
    decay = mx.exp(g) * keep[:, None]
    one = (x[:, None] for x in (q, k, v, decay, beta))
    rows, out = metal_gated_delta.gated_delta(pool, slots, *one, launch=Emulator().launch)
    want_out, want_pool = _decode(monkeypatch, *case, native=False)
    got = np.array(rows).reshape(-1, *want_pool.shape[1:])
    np.testing.assert_allclose(got, want_pool[[4, 0, 2]], atol=1e-4)
    np.testing.assert_allclose(np.array(out)[:, 0], want_out, atol=1e-4)


# The tiny checkpoints' heads, Qwen3.5's, and sizes that are no multiple of the kernels' blocks (an odd
# Dk: the CPU kernel's last row, the Metal kernel's idle lanes; Dv 40: a 32-column block, then one of 8).
RAGGED_SHAPES = [(4, 16, 8), (2, 128, 128), (3, 33, 40)]
# Per sequence: tokens, tokens computed before (0: starts from zeros over a slot of garbage), its slot.
RAGGED_BATCH = [(5, 7, 4), (1, 3, 0), (70, 0, 5), (3, 0, 2), (9, 20, 1)]


def _ragged_case(heads: int, dk: int, dv: int, batch=RAGGED_BATCH):
    """Padded ``[B, Qmax]`` inputs of mixed lengths (garbage in the padding), their layout, ``keep`` and
    a pool of seven slots, the sequences' in permuted order."""
    slices = [SequenceSlice(list(range(32)), done, n, state_slot=slot) for n, done, slot in batch]
    meta = build_metadata(slices, 4)
    q, k, v, g, beta, _ = _random_delta_inputs(len(batch), meta.max_query_len, heads, dk, dv)
    pool = mx.random.normal((7, 1, heads * (dk + 1) * dv), key=mx.random.key(2))
    return q, k, v, g, beta, pool, meta


def _sequences(monkeypatch, q, k, v, g, beta, pool, meta, native: bool) -> tuple[np.ndarray, np.ndarray]:
    """(each real row's output [T, H, Dv], the pool afterwards) of ``sequences_step`` with the kernel
    the backend binds (the native one here, Metal's where the test binds the emulator) or the chunked
    reference."""
    heads, dk, dv = q.shape[2], q.shape[3], v.shape[3]
    state = LayerState(pool.shape[0], StateSpec(((heads, dk + 1, dv),)))
    state.arrays[0] = mx.array(pool)
    layout = Ragged.of(meta)
    with monkeypatch.context() as patch:
        if not native:
            patch.setattr(cpu_kernels, "gated_delta", lambda *args: None)
        out = sequences_step(q, k, v, g, beta, state, 0, meta.state_slots, continuing(meta), layout)
        states = np.array(state.arrays[0]).reshape(pool.shape[0], heads, dk + 1, dv)
        return np.array(layout.unpad(out)), states


def _check_sequences(got: tuple[np.ndarray, np.ndarray], want: tuple[np.ndarray, np.ndarray], pool: mx.array):
    """Outputs and states as the reference's; each head's last output in the row after its matrix (the
    reference leaves zeros there); the slots no sequence uses untouched."""
    (out, states), (want_out, want_states) = got, want
    np.testing.assert_allclose(out, want_out, atol=1e-4)
    dk = states.shape[2] - 1
    np.testing.assert_allclose(states[:, :, :dk], want_states[:, :, :dk], atol=1e-4)
    ends = np.cumsum([n for n, _, _ in RAGGED_BATCH]) - 1
    np.testing.assert_allclose(states[[s for _, _, s in RAGGED_BATCH], :, dk], out[ends], atol=1e-6)
    np.testing.assert_array_equal(states[[3, 6]], np.array(pool).reshape(states.shape)[[3, 6]])


@pytest.mark.skipif(not cpu_kernels.available(), reason=cpu_kernels.unavailable_reason())
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_native_sequences_equal_the_chunked_reference(monkeypatch, shape):
    """Prefill rows of mixed lengths (1 to 70: the reference crosses a chunk), continuing sequences and
    sequences that start from zeros, slots in permuted order: the native kernel, in place in the pool."""
    case = _ragged_case(*shape)
    got = _sequences(monkeypatch, *case, native=True)
    _check_sequences(got, _sequences(monkeypatch, *case, native=False), case[5])


@pytest.mark.skipif(not toolchain_available(), reason="the Metal emulator needs `pip install ziglang`")
@pytest.mark.parametrize("shape", RAGGED_SHAPES)
def test_metal_sequences_equal_the_chunked_reference(monkeypatch, shape):
    """The same through the Metal kernel, run by the emulator, as dispatch binds it on a Mac."""
    case = _ragged_case(*shape)
    want = _sequences(monkeypatch, *case, native=False)
    saved = dispatch.USE_KERNELS
    dispatch.bind(True, Emulator().launch)
    try:
        got = _sequences(monkeypatch, *case, native=True)
    finally:
        dispatch.bind(saved)
    _check_sequences(got, want, case[5])


@pytest.mark.parametrize("native", [True, False], ids=["native", "reference"])
def test_hybrid_model_chunked_prefill_equals_transformers(monkeypatch, native):
    """Prefill in uneven chunks, then decode, through the native recurrence kernel (the CPU default) and
    through the MLX reference (MLX_INFER_KERNELS=reference, or no native kernels)."""
    if native and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    folder = TINY / "qwen3_5_text"
    ref = np.load(folder / "reference.npz")
    tokens, want = ref["tokens_1"], ref["logits_1"]
    model = load(str(folder)).model
    if not native:
        monkeypatch.setattr(cpu_kernels, "gated_delta", lambda *args: None)
    cache, rows, start = new_cache(model, 40, 4, mx.float32), [], 0
    for n in [70, 1, 33, 38] + [1] * 8:
        meta = build_metadata([SequenceSlice(list(range(40)), start, n, want_all_logits=True)], 4)
        rows.append(np.array(model(mx.array(tokens[start : start + n]), cache, meta)))
        start += n
    assert start == len(tokens)
    assert float(np.abs(np.concatenate(rows) - want).max()) < 2e-4


@pytest.mark.skipif(not toolchain_available(), reason="the Metal emulator needs `pip install ziglang`")
def test_hybrid_model_through_the_emulated_metal_kernels():
    """As on a Mac: every decode step's recurrence (and attention) through the Metal kernels, run by the
    emulator; prefill, then token-by-token decode, equals transformers."""
    folder = TINY / "qwen3_5_text"
    ref = np.load(folder / "reference.npz")
    tokens, want = ref["tokens_0"], ref["logits_0"]
    model = load(str(folder)).model
    with metal_kernels_emulated() as launched:
        cache, rows = new_cache(model, 16, 4, mx.float32), []
        for start, n in [(0, 15)] + [(i, 1) for i in range(15, len(tokens))]:
            meta = build_metadata([SequenceSlice(list(range(8)), start, n, want_all_logits=True)], 4)
            rows.append(np.array(model(mx.array(tokens[start : start + n]), cache, meta)))
    # Both DeltaNet layers' recurrence through the kernel: in the prefill and in each decode step.
    assert launched.count("gated_delta") == 2 * (1 + len(tokens) - 15)
    assert float(np.abs(np.concatenate(rows) - want).max()) < 2e-4


def test_convert_quantizes_a_composite_hybrid_checkpoint(tmp_path):
    """``convert`` of an image-text Qwen3.5-MoE checkpoint: the text model, 8-bit, loads back and agrees
    with the float model (the recurrent layers' small parameters stay float)."""
    parser = argparse.ArgumentParser()
    convert_cli.add_arguments(parser)
    out = tmp_path / "q8"
    args = ["--model", str(TINY / "qwen3_5_moe"), "--out", str(out), "--q-bits", "8", "--q-group-size", "32"]
    assert convert_cli.run(parser.parse_args([*args, "--no-eval"])) == 0
    ref = np.load(TINY / "qwen3_5_moe" / "reference.npz")
    tokens = ref["tokens_1"]
    model = load(str(out), keep_quantized=True).model
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())
    meta = build_metadata([SequenceSlice(list(range(64)), 0, len(tokens), want_all_logits=True)], 4)
    got = np.array(model(mx.array(tokens), new_cache(model, 64, 4, mx.float32), meta))
    assert (got.argmax(-1) == ref["logits_1"].argmax(-1)).mean() > 0.75
