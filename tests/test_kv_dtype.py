"""--kv-cache-dtype: float16, bfloat16 and int8 KV pools against float32, in every path that reads them.

int8 pools hold each (token, KV head) row as ``head_dim`` symmetric int8 values and their float32 scale
(``models/base.py: LayerKV``); the native CPU kernels, the Metal kernel (through the emulator) and the
pure-MLX reference read those rows where they lie. Tolerances are stated where they are used.
"""

from __future__ import annotations

import logging

import mlx.core as mx
import numpy as np
import pytest
from engine_helpers import CharTokenizer, tiny_llama
from test_kernels import EMU, attention_case, needs_emulator

from mlx_infer import cli, cpu_kernels
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.runner import kv_pool_dtype
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV, pool_rows, split_int8_rows
from mlx_infer.metal_kernels import paged_attention as pa
from mlx_infer.metal_kernels import reference
from mlx_infer.plan import planner
from mlx_infer.sampling import SamplingParams

LOSSY = ("float16", "bfloat16", "int8")
native = pytest.mark.skipif(not cpu_kernels.available(), reason="the native CPU kernels are not built here")


def pools(keys: mx.array, values: mx.array, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    return pool_rows(keys, dtype), pool_rows(values, dtype)


# ---- the stored rows ----------------------------------------------------------------------------------


def test_int8_rows_hold_values_and_scale_and_dequantize_within_half_a_step():
    rng = np.random.default_rng(0)
    x = mx.array(rng.standard_normal((40, 3, 64)).astype(np.float32) * rng.uniform(0.01, 30, (40, 3, 1)))
    x[5, 1] = 0.0  # an all-zero row: scale 0, values 0
    rows = pool_rows(x, mx.int8)
    assert rows.shape == (40, 3, 68) and rows.dtype == mx.int8
    q, scale = split_int8_rows(rows)
    np.testing.assert_allclose(np.array(scale), np.abs(np.array(x)).max(-1) / 127, rtol=1e-6)
    assert int(mx.abs(q).max()) == 127 and float(scale[5, 1]) == 0.0
    error = mx.abs(q.astype(mx.float32) * scale[..., None] - x)
    assert bool(mx.all(error <= scale[..., None] * 0.5 * (1 + 1e-5)))


@native
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int8])
def test_native_kv_write_stores_the_rows_the_mlx_write_stores(dtype):
    """Bit for bit (rounding ties to even, int8 ties and zero rows included), at permuted slots, from a
    strided view of float32 rows, as the native block writes them."""
    rng = np.random.default_rng(1)
    x = rng.integers(-40, 40, (30, 2, 32)).astype(np.float32) * 0.25  # many exact halves: ties
    x[3] = 0.0
    x = mx.array(np.concatenate([x, rng.standard_normal((30, 2, 32)).astype(np.float32)], axis=-1))[..., ::2]
    slots = mx.array(rng.permutation(64)[:30])
    empty = LayerKV(4, 16, 2, 32, dtype).keys
    written = cpu_kernels.kv_write(empty, x, slots)
    assert written.dtype == dtype and written.shape == empty.shape
    assert mx.array_equal(written[slots], pool_rows(x, dtype)).item()
    untouched = mx.array(sorted(set(range(64)) - set(np.array(slots).tolist())))
    assert not mx.any(written[untouched]).item()


# ---- attention over each pool dtype -------------------------------------------------------------------

# Float32 queries over pools of SmolLM2's heads (9 query, 3 KV, head_dim 64): decodes at contexts 1, 15,
# 17, 300 and a prefill chunk of 5 after 35 cached tokens, permuted block tables.
CASE = ([1, 15, 17, 300, 40], [1, 1, 1, 1, 5], 9, 3, 64)
# Largest |output - float32 output| of unit-variance K/V, from the pool's rounding alone; measured on
# three seeds: float16 7e-4 to 1e-3, bfloat16 6e-3 to 8e-3, int8 1.4e-2 to 1.5e-2. Bounds about 2x.
POOL_ERROR = {mx.float16: 2e-3, mx.bfloat16: 1.6e-2, mx.int8: 3e-2}


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.int8])
def test_reference_attends_each_pool_dtype_close_to_float32(dtype):
    q, k, v, meta = attention_case(*CASE, mx.float32)
    exact = reference.paged_attention(q, k, v, meta, 0.125)
    out = reference.paged_attention(q, *pools(k, v, dtype), meta, 0.125)
    assert out.dtype == mx.float32
    error = float(mx.abs(out - exact).max())
    assert 0 < error < POOL_ERROR[dtype]


@native
@pytest.mark.parametrize("window,softcap", [(None, None), (20, None), (None, 5.0)])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.int8])
def test_native_attention_reads_each_pool_dtype_as_the_reference(dtype, window, softcap):
    q, k, v, meta = attention_case(*CASE, mx.float32, seed=4)
    kp, vp = pools(k, v, dtype)
    expect = reference.paged_attention(q, kp, vp, meta, 0.125, window, softcap)
    out = cpu_kernels.paged_attention(q, kp, vp, meta, 0.125, window, softcap)
    np.testing.assert_allclose(np.array(out), np.array(expect), rtol=1e-4, atol=5e-6)


@needs_emulator
@pytest.mark.parametrize("partition_keys", [None, 64])
@pytest.mark.parametrize(
    "dtype,q_dtype,atol",
    [(mx.int8, mx.float32, 5e-6), (mx.float16, mx.float32, 5e-6), (mx.int8, mx.float16, 4e-3),
     (mx.float16, mx.bfloat16, 3e-2)],
)
def test_metal_kernel_reads_int8_and_half_pools_as_the_reference(dtype, q_dtype, atol, partition_keys):
    """The kernel body run by the emulator, whole and split-KV, against the reference on the same pools."""
    q, k, v, meta = attention_case([1, 15, 17, 300], [1] * 4, 6, 2, 64, mx.float32, seed=5)
    kp, vp = pools(k, v, dtype)
    expect = reference.paged_attention(q, kp, vp, meta, 0.125)
    out = pa.paged_attention(q.astype(q_dtype), kp, vp, meta, 0.125, launch=EMU,
                             partition_keys=partition_keys)
    assert out.dtype == q_dtype
    assert float(mx.abs(out.astype(mx.float32) - expect).max()) < atol


# ---- a model decoding over each pool dtype ------------------------------------------------------------


def decode_logprobs(model, kv_dtype: mx.Dtype, tokens: list[int]) -> np.ndarray:
    """Log-probs after each token: a prefill of two chunks, then one token a step, over a permuted
    block table of 4-token blocks."""
    n_kv, head_dim = model.kv_shape()
    table = [int(b) for b in np.random.default_rng(2).permutation(12)]
    cache = [LayerKV(12, 4, n_kv, head_dim, kv_dtype) for _ in model.layers]
    steps = [(0, 13), (13, 8)] + [(n, 1) for n in range(21, len(tokens))]
    rows = []
    for done, new in steps:
        meta = build_metadata([SequenceSlice(table, done, new, want_all_logits=True)], 4)
        logits = model(mx.array(tokens[done : done + new]), cache, meta).astype(mx.float32)
        rows.append(np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True)))
    assert cache[0].keys.dtype == kv_dtype
    return np.concatenate(rows)


# Mean / largest KL(float32 KV || this KV) per position of the tiny model (head_dim 16, weights scaled
# up: sharper than a real model's), native and reference paths alike; measured: float16 5.3e-6 / 3.1e-5,
# bfloat16 5.9e-4 / 3.2e-3, int8 3.9e-3 / 3.2e-2. Bounds about 2x.
MODEL_KL = {"float16": (1.5e-5, 1e-4), "bfloat16": (1.5e-3, 1e-2), "int8": (8e-3, 6e-2)}


@pytest.fixture(scope="module")
def model():
    return tiny_llama(layers=3)


@pytest.mark.parametrize("kernels", ["native", "reference"])
@pytest.mark.parametrize("kv", LOSSY)
def test_model_decode_over_each_kv_dtype_is_close_to_float32(model, kv, kernels, monkeypatch):
    if kernels == "native" and not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built here")
    if kernels == "reference":
        monkeypatch.setattr(cpu_kernels, "applies", lambda: False)
    tokens = [int(t) for t in np.random.default_rng(3).integers(1, 60, 40)]
    exact = decode_logprobs(model, mx.float32, tokens)
    ours = decode_logprobs(model, getattr(mx, kv), tokens)
    kl = np.sum(np.exp(exact) * (exact - ours), axis=-1)
    most_mean, most_max = MODEL_KL[kv]
    print(f"{kv} {kernels}: mean KL {kl.mean():.2e}, max {kl.max():.2e}")
    assert 0 < kl.mean() <= most_mean and kl.max() <= most_max
    assert np.mean(exact.argmax(-1) == ours.argmax(-1)) >= 0.95


# ---- the engine with int8 KV: prefix cache, preemption -----------------------------------------------


def int8_engine(model, num_blocks: int, budget: int = 512) -> Engine:
    config = EngineConfig(
        block_size=4, num_blocks=num_blocks, kv_cache_dtype="int8",
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget),
    )
    engine = Engine(model, CharTokenizer(), 256, config)
    assert all(layer.keys.dtype == mx.int8 for layer in engine.runner.cache)
    return engine


def answers(engine: Engine, prompts: list[list[int]], max_tokens: int = 12) -> list[list[int]]:
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert engine.kv.pool.num_used == 0
    return [out[i] for i in ids]


PROMPTS = [list(range(5, 23)), [3, 4, 5], list(range(1, 40)), [9] * 20]


def test_int8_prefix_cache_hits_answer_as_a_cold_prompt(model):
    """A prompt served from cached int8 blocks reads the rows a cold run writes: the same tokens."""
    cold = answers(int8_engine(model, 64), [PROMPTS[2]])[0]
    engine = int8_engine(model, 64)
    answers(engine, [PROMPTS[2][:32]])
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=12, ignore_eos=True))
    tokens, cached = [], 0
    while engine.has_unfinished():
        for o in engine.step():
            tokens.extend(o.token_ids)
            cached = max(cached, o.num_cached_tokens)
    assert cached >= 28  # the first 7 blocks of 4 came from the prefix cache
    assert tokens == cold


def test_int8_preemption_recomputes_the_same_answers(model):
    alone = [answers(int8_engine(model, 64), [p])[0] for p in PROMPTS]
    engine = int8_engine(model, 14, budget=8)  # 14 blocks of 4 cannot hold all four: preemption
    assert answers(engine, PROMPTS) == alone
    assert engine.scheduler.num_preemptions > 0


# ---- flags, sizes, the startup line -------------------------------------------------------------------


def test_bad_kv_cache_dtype_is_one_line_and_a_nonzero_exit(capsys):
    code = cli.main(["generate", "-m", "no-such-model", "--kv-cache-dtype", "int4", "-p", "hi"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0
    assert err == ["mlx-infer generate: error: unknown --kv-cache-dtype 'int4'; choose one of auto, float32, "
                   "float16, bfloat16, int8"]


def test_auto_is_float16_on_the_cpu_backend_and_the_compute_dtype_on_metal(monkeypatch):
    monkeypatch.setattr(planner, "backend_name", lambda: "cpu")
    assert kv_pool_dtype("auto", mx.float32) == mx.float16
    assert kv_pool_dtype("int8", mx.float32) == mx.int8
    monkeypatch.setattr(planner, "backend_name", lambda: "metal")
    assert kv_pool_dtype("auto", mx.bfloat16) == mx.bfloat16
    assert kv_pool_dtype("float32", mx.bfloat16) == mx.float32


def test_tokens_that_fit_the_same_kv_memory_per_dtype(caplog):
    """head_dim 64: a token's K and V row per KV head is 256 bytes in float32, 128 in half, 68 in int8
    (64 values and a 4-byte scale): int8 holds 3.76x float32's tokens. The startup line says so."""
    model = tiny_llama(layers=2)
    model.args.head_dim = 64  # kv_shape(): pools only, the layers are not run here
    fits = {}
    for kv in ("float32", "float16", "bfloat16", "int8"):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="mlx_infer"):
            engine = Engine(model, CharTokenizer(), 256, EngineConfig(kv_memory=0.01, kv_cache_dtype=kv))
        fits[kv] = engine.pool_tokens
        line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache:"))
        assert line.startswith(f"KV cache: {kv}, ") and f"= {engine.pool_tokens} tokens" in line
    per_token = {"float32": 256, "float16": 128, "bfloat16": 128, "int8": 68}
    for kv, tokens in fits.items():
        expect = int(0.01 * 2**30) // (2 * 2 * 2 * per_token[kv]) // 16 * 16
        assert tokens == expect, (kv, tokens, expect)
    assert fits["int8"] >= 3.5 * fits["float32"]
