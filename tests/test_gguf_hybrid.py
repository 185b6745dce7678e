"""GGUF files of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) written by llama.cpp's own
converter from the tiny checkpoints (tests/oracle/make_tiny_gguf.py): its A = -exp(A_log), squeezed
convolutions, norms stored plus one, split (Qwen3-Next) and tiled (Qwen3.5) value heads must load back to
transformers' logits (the folder's reference.npz), and the memory plan must count what loads.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.engine.batch import SequenceSlice, build_metadata
from mlx_infer.loading import load
from mlx_infer.loading.gguf_hybrid import untile
from mlx_infer.models import base
from mlx_infer.plan import make_plan

TINY = Path(__file__).parent / "oracle" / "tiny"
BLOCK = 4
TOL = 2e-4  # test_architectures.py's

# folder -> model type the GGUF loads as
CASES = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}


def prefill_then_decode(model, tokens: np.ndarray) -> np.ndarray:
    """Logits of every position: two prefill chunks (the second crossing DeltaNet's 64-token chunks), then
    one decode step each for the last three tokens."""
    n_blocks = -(-len(tokens) // BLOCK) + 4
    cache = base.new_cache(model, n_blocks, BLOCK, mx.float32, num_state_slots=1)
    table = [int(b) for b in np.random.default_rng(0).permutation(n_blocks)]
    done, rows = 0, []
    first = len(tokens) // 3
    for n in [first, len(tokens) - first - 3, 1, 1, 1]:
        meta = build_metadata([SequenceSlice(table, done, n, True)], BLOCK)
        out = model(mx.array(tokens[done : done + n], dtype=mx.int32), cache, meta)
        rows.append(np.array(out.astype(mx.float32)))
        done += n
    return np.concatenate(rows)


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_written_by_llama_cpps_converter_equals_transformers(name: str):
    folder = TINY / name
    ref = np.load(folder / "reference.npz")
    tol = max(TOL, 5 * float(ref["float32_noise"]))
    path = folder / "model.f32.gguf"
    loaded = load(str(path))
    assert loaded.config["model_type"] == CASES[name]
    assert loaded.config["layer_types"] == ["linear_attention", "full_attention"] * 2
    for i in range(2):
        err = np.abs(prefill_then_decode(loaded.model, ref[f"tokens_{i}"]) - ref[f"logits_{i}"]).max()
        assert err <= tol, f"{name}: max |logit - transformers'| = {err:.2e}"
    held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert make_plan(str(path), context=64, backend="cpu").weights_bytes == held


def test_untile_inverts_the_converters_value_head_order():
    """convert_hf_to_gguf.py's _reorder_v_heads: view the axis as [key heads, per key head, head dim] and
    swap the first two. Here 2 key heads serve 6 value heads of 3 values each, along rows and columns."""
    hk, per, d = 2, 3, 3
    grouped = np.arange(hk * per * d * 5, dtype=np.float32).reshape(hk * per * d, 5)
    tiled = grouped.reshape(hk, per, d, 5).swapaxes(0, 1).reshape(grouped.shape)
    assert np.array_equal(np.array(untile(mx.array(tiled), hk, hk * per)), grouped)
    assert np.array_equal(np.array(untile(mx.array(tiled.T), hk, hk * per, axis=-1)), grouped.T)
