"""Kernels (run by the Metal emulator) equal their references; references equal NumPy and gguf.quants."""

from __future__ import annotations

import dataclasses
import os

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import make_tiny_llama
from emulated import metal_kernels_emulated

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import policy
from mlx_infer.metal_kernels import dispatch, gguf_reference, quantized, reference
from mlx_infer.metal_kernels import paged_attention as pa
from mlx_infer.metal_kernels.emulator import Emulator, EmulatorError, toolchain_available
from mlx_infer.metal_kernels.layers import KernelQuantizedEmbedding, KernelQuantizedLinear

needs_emulator = pytest.mark.skipif(not toolchain_available(),
                                    reason="the emulator needs `pip install ziglang`")
EMU = Emulator().launch
# Absolute tolerance on outputs of unit scale, per output dtype (float32 references).
ATOL = {mx.float32: 2e-5, mx.float16: 4e-3, mx.bfloat16: 3e-2}
BLOCK = 16


def batch(context_lens: list[int], query_lens: list[int], n_blocks: int, seed: int):
    """Metadata over a permuted (non-contiguous) block table: sequence i gets scattered blocks."""
    perm = np.random.default_rng(seed).permutation(n_blocks)
    slices, used = [], 0
    for ctx, q in zip(context_lens, query_lens):
        nb = -(-ctx // BLOCK)
        slices.append(SequenceSlice([int(b) for b in perm[used: used + nb]], ctx - q, q))
        used += nb
    assert used <= n_blocks
    return build_metadata(slices, BLOCK)


def attention_case(context_lens, query_lens, n_heads, n_kv, head_dim, dtype, seed=0):
    rng = np.random.default_rng(seed)
    n_blocks = sum(-(-c // BLOCK) for c in context_lens) + 3
    meta = batch(context_lens, query_lens, n_blocks, seed)
    pool = (n_blocks * BLOCK, n_kv, head_dim)
    keys = mx.array(rng.standard_normal(pool).astype(np.float32)).astype(dtype)
    values = mx.array(rng.standard_normal(pool).astype(np.float32)).astype(dtype)
    q_shape = (sum(query_lens), n_heads, head_dim)
    queries = mx.array(rng.standard_normal(q_shape).astype(np.float32)).astype(dtype)
    return queries, keys, values, meta


def attention_error(queries, keys, values, meta, **kw) -> tuple[float, mx.Dtype]:
    scale = queries.shape[-1] ** -0.5
    window, softcap = kw.pop("sliding_window", None), kw.pop("logit_softcap", None)
    out = pa.paged_attention(queries, keys, values, meta, scale, window, softcap, launch=EMU, **kw)
    expect = reference.paged_attention(queries.astype(mx.float32), keys.astype(mx.float32),
                                       values.astype(mx.float32), meta, scale, window, softcap)
    assert out.shape == queries.shape and out.dtype == queries.dtype
    return float(mx.abs(out.astype(mx.float32) - expect).max()), queries.dtype


DECODE_CONTEXTS = [1, 15, 16, 17, 300]


@needs_emulator
@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim,dtype",
    [(4, 4, 64, mx.float32), (6, 2, 80, mx.float16), (8, 2, 96, mx.bfloat16), (4, 1, 128, mx.float16),
     (3, 1, 64, mx.bfloat16), (4, 4, 128, mx.float32)],
)
def test_decode_matches_reference(n_heads, n_kv, head_dim, dtype):
    case = attention_case(DECODE_CONTEXTS, [1] * 5, n_heads, n_kv, head_dim, dtype)
    error, dtype = attention_error(*case)
    assert error < ATOL[dtype]


@needs_emulator
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_split_kv_with_reduce_matches_reference(dtype):
    case = attention_case(DECODE_CONTEXTS, [1] * 5, 6, 2, 64, dtype, seed=1)
    error, dtype = attention_error(*case, partition_keys=64)  # 300 keys -> 5 partitions, some empty
    assert error < ATOL[dtype]


@needs_emulator
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_prefill_chunks_attend_to_cache_and_their_causal_part(dtype):
    # A fresh prompt, a chunk after 20 cached tokens, and a decode, in one ragged batch.
    case = attention_case([7, 37, 17], [7, 17, 1], 6, 2, 64, dtype, seed=2)
    error, dtype = attention_error(*case)
    assert error < ATOL[dtype]


@needs_emulator
def test_sliding_window_and_softcap_match_reference():
    case = attention_case([40, 300], [3, 1], 4, 2, 64, mx.float32, seed=3)
    error, _ = attention_error(*case, sliding_window=20, logit_softcap=5.0)
    assert error < ATOL[mx.float32]


@needs_emulator
def test_off_by_one_kernel_is_caught():
    # Reading one key past the context must fail: either a fault or a wrong answer.
    broken = dataclasses.replace(pa.ATTENTION, source=pa.ATTENTION.source.replace("j < stop", "j <= stop"))
    queries, keys, values, meta = attention_case(DECODE_CONTEXTS, [1] * 5, 4, 2, 64, mx.float32)

    def launch(spec, **kw):
        return EMU(broken if spec is pa.ATTENTION else spec, **kw)

    try:
        out = pa.paged_attention(queries, keys, values, meta, 0.125, launch=launch)
    except EmulatorError:
        return
    expect = reference.paged_attention(queries, keys, values, meta, 0.125)
    assert float(mx.abs(out - expect).max()) > 1e-3


# ---- quantized matvec ------------------------------------------------------------------------------

def affine_case(bits, group, dtype, rows=3, k=256, n=40, seed=0):
    rng = np.random.default_rng(seed)
    w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
    wq, scales, biases = mx.quantize(w, group_size=group, bits=bits)
    x = mx.array(rng.standard_normal((rows, k)).astype(np.float32) / 8).astype(dtype)
    bias = mx.array(rng.standard_normal((n,)).astype(np.float32)).astype(dtype)
    residual = mx.array(rng.standard_normal((rows, n)).astype(np.float32)).astype(dtype)
    return x, wq, scales.astype(dtype), biases.astype(dtype), bias, residual


@needs_emulator
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group,dtype", [(32, mx.float16), (64, mx.bfloat16), (128, mx.float32)])
def test_affine_matvec_matches_reference(bits, group, dtype):
    x, wq, scales, biases, bias, residual = affine_case(bits, group, dtype)
    out = quantized.affine_matvec(x, wq, scales, biases, group, bits, bias, residual, launch=EMU)
    f32 = [a.astype(mx.float32) for a in (x, scales, biases, bias, residual)]
    expect = reference.quantized_matmul(f32[0], wq, f32[1], f32[2], group, bits, f32[3], f32[4])
    assert out.dtype == dtype
    assert float(mx.abs(out.astype(mx.float32) - expect).max()) < ATOL[dtype] * 4


@needs_emulator
def test_affine_matvec_without_epilogue_single_row():
    x, wq, scales, biases, _, _ = affine_case(4, 64, mx.float32, rows=1, k=512, n=9, seed=4)
    out = quantized.affine_matvec(x, wq, scales, biases, 64, 4, launch=EMU)
    expect = reference.quantized_matmul(x, wq, scales, biases, 64, 4)
    assert float(mx.abs(out - expect).max()) < 1e-4


def random_kquant(kind: str, rows: int, k: int, seed: int) -> np.ndarray:
    """Random K-quant rows with sane float16 super-block scales (random bytes there would be inf/NaN)."""
    rng = np.random.default_rng(seed)
    size = gguf_reference.BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (rows, k // 256, size), dtype=np.uint8)

    def f16():
        scales = rng.uniform(1e-3, 4e-2, (rows, k // 256)).astype(np.float16)
        return scales.view(np.uint8).reshape(rows, -1, 2)

    if kind in ("Q4_K", "Q5_K"):
        raw[..., 0:2], raw[..., 2:4] = f16(), f16()  # d, dmin
    else:
        raw[..., 208:210] = f16()
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
def test_kquant_reference_matches_gguf_quants(kind):
    from gguf import GGMLQuantizationType, quants

    raw = random_kquant(kind, 5, 768, seed=5)
    expect = quants.dequantize(raw, getattr(GGMLQuantizationType, kind))
    np.testing.assert_array_equal(np.asarray(gguf_reference.DEQUANTIZE[kind](mx.array(raw))), expect)


@needs_emulator
@pytest.mark.parametrize("kind,dtype", [("Q4_K", mx.float32), ("Q6_K", mx.float16), ("Q4_K", mx.bfloat16),
                                        ("Q5_K", mx.float32), ("Q5_K", mx.float16), ("Q5_K", mx.bfloat16)])
def test_kquant_matvec_matches_reference(kind, dtype):
    raw = mx.array(random_kquant(kind, 20, 512, seed=6))
    rng = np.random.default_rng(7)
    x = mx.array(rng.standard_normal((2, 512)).astype(np.float32) / 16).astype(dtype)
    bias = mx.array(rng.standard_normal((20,)).astype(np.float32)).astype(dtype)
    out = quantized.kquant_matvec(x, raw, kind, bias, launch=EMU)
    expect = gguf_reference.gguf_matmul(x.astype(mx.float32), raw, kind, bias.astype(mx.float32))
    scale = float(mx.abs(expect).max())
    assert float(mx.abs(out.astype(mx.float32) - expect).max()) < ATOL[dtype] * max(scale, 1.0)


# ---- models through the kernel dispatch -----------------------------------------------------------------

@pytest.fixture
def emulated_kernels():
    """The dispatch bound to the kernels as on a Mac, with the emulator as their launcher; yields the
    names of the kernels launched."""
    with metal_kernels_emulated() as launched:
        yield launched


def two_steps(model: nn.Module) -> list[np.ndarray]:
    """Logits of a ragged batch: prefill chunks of 5 and 3 tokens (8 rows, still matvecs), then one decode
    step of both sequences."""
    cache = new_cache(model, 4, BLOCK, mx.float32)
    prefill = [SequenceSlice([2], 0, 5, want_all_logits=True), SequenceSlice([0], 0, 3, want_all_logits=True)]
    steps = [(prefill, [3, 14, 15, 9, 26, 5, 35, 8]),
             ([SequenceSlice([2], 5, 1), SequenceSlice([0], 3, 1)], [42, 7])]
    return [np.array(model(mx.array(tokens), cache, build_metadata(slices, BLOCK)))
            for slices, tokens in steps]


@needs_emulator
def test_quantized_model_runs_through_the_kernels_on_metal(emulated_kernels, monkeypatch):
    """On Metal the policy swaps quantized layers for kernel-dispatch twins; the emulated kernels (affine
    matvec in every layer and the tied head, paged attention) give the reference path's logits."""
    monkeypatch.setattr(policy, "cpu_backend", lambda: False)
    # Head dim 64; 4-bit groups 64 and 128, an 8-bit group-32 tied embedding (the head).
    model = make_tiny_llama(6, hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                            intermediate_size=256, tie_word_embeddings=True)

    def recipe(path: str, module: nn.Module) -> bool | dict:
        if path.endswith("embed_tokens"):
            return {"group_size": 32, "bits": 8}
        if path.endswith("down_proj"):
            return {"group_size": 128, "bits": 4}
        return hasattr(module, "to_quantized")

    nn.quantize(model, group_size=64, bits=4, class_predicate=recipe)
    assert "quantized 4-bit/8-bit" in policy.apply_weight_policy(model, None)
    linears = [m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear)]
    assert len(linears) == 14 and all(type(m) is KernelQuantizedLinear for m in linears)
    assert type(model.model.embed_tokens) is KernelQuantizedEmbedding

    kernels = two_steps(model)
    assert {"affine_qmv", "paged_attention"} <= set(emulated_kernels)
    dispatch.bind(False)
    for got, expect in zip(kernels, two_steps(model)):
        assert got.shape == expect.shape
        np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())


@pytest.mark.parametrize("cpu_kernels_available", [True, False])
def test_dispatch_twins_stay_off_metal(cpu_kernels_available: bool, monkeypatch: pytest.MonkeyPatch):
    """Off Metal (the real policy) quantized layers become the dispatch twins where the native CPU
    kernels are built (dispatch then routes them to those kernels), else they stay MLX's own."""
    if mx.metal.is_available():
        pytest.skip("Metal is available: the policy swaps in the kernel layers")
    monkeypatch.setattr(cpu_kernels, "available", lambda: cpu_kernels_available)
    model = make_tiny_llama(6)
    nn.quantize(model, group_size=64, bits=4)
    policy.apply_weight_policy(model, True)
    linear, embedding = (
        (KernelQuantizedLinear, KernelQuantizedEmbedding) if cpu_kernels_available
        else (nn.QuantizedLinear, nn.QuantizedEmbedding)
    )
    assert type(model.lm_head) is linear
    assert type(model.model.embed_tokens) is embedding


# ---- references against NumPy -------------------------------------------------------------------------

def test_paged_attention_reference_matches_numpy():
    queries, keys, values, meta = attention_case([5, 20], [2, 1], 4, 2, 16, mx.float32, seed=8)
    out = np.asarray(reference.paged_attention(queries, keys, values, meta, 0.25, sliding_window=6))
    q, k, v = np.asarray(queries), np.asarray(keys), np.asarray(values)
    tables, positions = np.asarray(meta.block_tables), np.asarray(meta.positions)
    seqs = [0, 0, 1]
    for t, (seq, pos) in enumerate(zip(seqs, positions)):
        js = np.arange(max(0, pos - 5), pos + 1)
        slots = tables[seq, js // BLOCK] * BLOCK + js % BLOCK
        for h in range(4):
            s = k[slots, h // 2] @ q[t, h] * 0.25
            p = np.exp(s - s.max())
            np.testing.assert_allclose(out[t, h], p @ v[slots, h // 2] / p.sum(), rtol=1e-5, atol=1e-5)


def test_quantized_reference_matches_numpy():
    x, wq, scales, biases, bias, residual = affine_case(4, 32, mx.float32, rows=2, k=64, n=5)
    packed = np.asarray(wq).view(np.uint8)
    q = np.stack([packed & 15, packed >> 4], axis=-1).reshape(5, 64).astype(np.float32)  # low nibble first
    w = q * np.repeat(np.asarray(scales), 32, axis=1) + np.repeat(np.asarray(biases), 32, axis=1)
    expect = np.asarray(x) @ w.T + np.asarray(bias) + np.asarray(residual)
    out = reference.quantized_matmul(x, wq, scales, biases, 32, 4, bias, residual)
    np.testing.assert_allclose(np.asarray(out), expect, rtol=1e-5, atol=1e-5)


def test_dispatch_is_the_reference_off_metal():
    if mx.metal.is_available():
        pytest.skip("Metal is available: dispatch picks the kernels")
    # Attention and affine products go through the native CPU kernels where they are built
    # (tests/test_cpu_kernels.py), else through these references.
    assert dispatch.paged_attention is dispatch._cpu_paged_attention
    assert dispatch.quantized_matmul is dispatch._cpu_quantized_matmul
    assert dispatch.gguf_matmul is gguf_reference.gguf_matmul


@needs_emulator
@pytest.mark.skipif(os.environ.get("MLX_INFER_EMULATOR_TSAN") != "1",
                    reason="ThreadSanitizer builds need zig's TSan runtime (about 8 minutes to build once); "
                           "set MLX_INFER_EMULATOR_TSAN=1")
def test_kernels_are_race_free_under_thread_sanitizer():
    tsan = Emulator(tsan=True).launch
    queries, keys, values, meta = attention_case([1, 17, 40], [1, 1, 1], 4, 2, 64, mx.float16)
    f32 = [a.astype(mx.float32) for a in (queries, keys, values)]
    expect = reference.paged_attention(*f32, meta, 0.125)
    for partition_keys in (None, 16):
        out = pa.paged_attention(queries, keys, values, meta, 0.125, launch=tsan,
                                 partition_keys=partition_keys)
        assert float(mx.abs(out.astype(mx.float32) - expect).max()) < ATOL[mx.float16]
    x, wq, scales, biases, bias, residual = affine_case(4, 32, mx.float32)
    out = quantized.affine_matvec(x, wq, scales, biases, 32, 4, bias, residual, launch=tsan)
    expect = reference.quantized_matmul(x, wq, scales, biases, 32, 4, bias, residual)
    assert float(mx.abs(out - expect).max()) < 1e-4
