"""The CPU decode-step rewrite (models/fused.py, models/rope_cpu.py) against the plain model.

Oracles: the same model without :func:`fuse_projections` (and ``mx.fast.rope`` for the RoPE tables),
on tiny random models of every architecture (logits within float32 tolerance) and on the real SmolLM2
(identical greedy tokens through the engine).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_models import CONFIGS, build, hf_weights, new_cache, step, tokens_for

from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.loading import load
from mlx_infer.models.base import rope_frequencies
from mlx_infer.models.fused import FusedLinear, FusedMLP, fuse_projections
from mlx_infer.models.rope_cpu import apply_rope_cpu
from mlx_infer.sampling import SamplingParams

TOL = 2e-5


def _paged_run(model) -> np.ndarray:
    """Logits of a prefill chunk, decode steps and a ragged batch (decode + prefill) in one cache."""
    cache = new_cache(model)
    a, b = tokens_for(1, 9), tokens_for(2, 6)
    rows = [step(model, cache, [SequenceSlice([17, 3, 11], 0, 5, True)], a[:5])]
    for i in range(5, 8):
        rows.append(step(model, cache, [SequenceSlice([17, 3, 11], i, 1)], a[i : i + 1]))
    ragged = [SequenceSlice([17, 3, 11], 8, 1), SequenceSlice([4, 9], 0, 6)]
    rows.append(step(model, cache, ragged, a[8:] + b))
    return np.concatenate(rows)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fused_model_matches_plain_model(name):
    cfg = CONFIGS[name]
    weights = hf_weights(cfg)
    plain, fused = build(cfg, weights), build(cfg, weights)
    summary = fuse_projections(fused)

    assert "fused q/k/v" in summary
    if name.startswith(("llama", "qwen", "gemma3")):
        assert any(isinstance(m, FusedLinear) for _, m in fused.named_modules())
    if name in ("llama", "qwen2", "qwen3", "gemma3_text", "gemma3"):
        assert any(isinstance(m, FusedMLP) for _, m in fused.named_modules())
    np.testing.assert_allclose(_paged_run(fused), _paged_run(plain), atol=TOL, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3_text"])
def test_parameters_keep_their_names_shapes_and_values(name, tmp_path: Path):
    cfg = CONFIGS[name]
    weights = hf_weights(cfg)
    plain, fused = build(cfg, weights), build(cfg, weights)
    fuse_projections(fused)
    want, got = dict(tree_flatten(plain.parameters())), dict(tree_flatten(fused.parameters()))
    assert list(got) == list(want)
    for key, value in want.items():
        assert got[key].shape == value.shape and got[key].dtype == value.dtype, key
        np.testing.assert_array_equal(np.array(got[key]), np.array(value), err_msg=key)
    # Saving writes the Hugging Face tensors, not the fused ones.
    path = tmp_path / "fused.safetensors"
    mx.save_safetensors(str(path), dict(tree_flatten(fused.parameters())))
    saved = mx.load(str(path))
    assert sorted(saved) == sorted(want)
    for key, value in want.items():
        np.testing.assert_array_equal(np.array(saved[key]), np.array(value), err_msg=key)


def test_replaced_weights_are_used_instead_of_the_stale_fused_ones():
    cfg = CONFIGS["qwen2"]  # q/k/v biases too
    old, new = hf_weights(cfg, seed=0), hf_weights(cfg, seed=1)
    fused, want = build(cfg, old), build(cfg, new)
    fuse_projections(fused)
    fused.load_weights([(k, v) for k, v in tree_flatten(want.parameters())])
    np.testing.assert_allclose(_paged_run(fused), _paged_run(want), atol=TOL, rtol=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize(
    ("head_dim", "dims", "llama3"), [(64, 64, False), (96, 64, False), (128, 128, True)]
)
def test_cpu_rope_equals_mx_fast_rope_bit_for_bit(dtype, head_dim, dims, llama3):
    scaling = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=8192)
    freqs = rope_frequencies(dims, 500000.0, scaling) if llama3 else None
    positions = mx.array([3, 100, 7, 2000, 0], dtype=mx.int32)
    x = mx.random.normal((5, 3, head_dim), key=mx.random.key(0)).astype(dtype)
    want = mx.fast.rope(x[:, :, None], dims, traditional=False, base=None if llama3 else 10000.0, scale=0.5,
                        offset=positions, freqs=freqs)[:, :, 0]
    got = apply_rope_cpu(x, positions, dims, 10000.0, 0.5, freqs)
    assert got.dtype == dtype
    assert mx.array_equal(got, want).item()


def _plain_load(path: Path):
    """What ``load`` builds before it prepares the model for the backend (``prepare_for_backend``):
    the model op by op."""
    from mlx_infer.loading import open_checkpoint
    from mlx_infer.loading.build import build_model
    from mlx_infer.loading.policy import apply_weight_policy

    ckpt = open_checkpoint(str(path))
    model = build_model(ckpt.config, ckpt.weights, path.name)
    apply_weight_policy(model, None, ckpt.requantize)
    mx.eval(model.parameters())
    return model, ckpt.tokenizer


def _engine_greedy(model, tokenizer, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    engine = Engine(model, tokenizer, 2048, EngineConfig(num_blocks=16))
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return [out[i] for i in ids]


def _plain_greedy(model, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy continuations from the model called directly: one ragged prefill, then batched decodes."""
    block = 16
    per_seq = -(-(max(map(len, prompts)) + max_tokens) // block)
    cache = new_cache(model, per_seq * len(prompts), block, mx.float32)
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    slices = [SequenceSlice(t, 0, len(p)) for t, p in zip(tables, prompts)]
    tokens = [tok for p in prompts for tok in p]
    out: list[list[int]] = [[] for _ in prompts]
    for _ in range(max_tokens):
        logits = model(mx.array(tokens, dtype=mx.int32), cache, build_metadata(slices, block))
        tokens = mx.argmax(logits, axis=-1).tolist()
        for seq, tok in zip(out, tokens):
            seq.append(tok)
        slices = [SequenceSlice(s.block_table, s.num_computed + s.num_new, 1) for s in slices]
    return out


def test_engine_greedy_tokens_equal_plain_model_on_smollm2(smollm2_path):
    model, tokenizer = _plain_load(smollm2_path)
    prompts = [tokenizer.encode("The capital of France is"), tokenizer.encode("def fibonacci(n):")]
    want = _plain_greedy(model, prompts, 16)
    assert all(getattr(layer.self_attn.q_proj, "_fused", None) is None for layer in model.layers)

    prepared = load(str(smollm2_path)).model  # the loader readies it for the CPU: fused, native blocks
    assert all(getattr(layer.self_attn.q_proj, "_fused", None) is not None for layer in prepared.layers)
    assert _engine_greedy(prepared, tokenizer, prompts, 16) == want
    assert _engine_greedy(prepared, tokenizer, prompts[1:], 16) == want[1:]  # batch 1: matrix-vector products
