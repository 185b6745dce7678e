"""GGUF files of the Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5, Qwen3.5-MoE) written by llama.cpp's own
converter from the tiny checkpoints (tests/oracle/make_tiny_gguf.py): its A = -exp(A_log), squeezed
convolutions, norms stored plus one, split (Qwen3-Next) and tiled (Qwen3.5) value heads must load back to
transformers' logits (the folder's reference.npz), and the memory plan must count what loads.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.engine.batch import SequenceSlice, build_metadata
from mlx_infer.loading import load
from mlx_infer.loading.gguf_file import read_header
from mlx_infer.loading.gguf_hybrid import untile
from mlx_infer.models import base
from mlx_infer.plan import make_plan

TINY = Path(__file__).parent / "oracle" / "tiny"
BLOCK = 4
TOL = 2e-4  # test_architectures.py's

# folder -> model type the GGUF loads as. Qwen3-Next's file (which carries a multi-token-prediction layer
# after the model's, as real conversions do) loads as Qwen3.5-MoE's text model (loading/gguf_hybrid.py).
CASES = {
    "qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_next_all_moe": "qwen3_5_moe_text"
}


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


def rewrite_gguf(src: Path, dst: Path, change) -> None:
    """Copy ``src`` to ``dst``: its metadata as it is, its tensors as ``change(tensors)`` returns them."""
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        array = field.types[0] == gguf.GGUFValueType.ARRAY
        writer.add_key_value(name, field.contents(), field.types[0], field.types[-1] if array else None)
    tensors = {t.name: np.array(t.data).reshape(tuple(reversed(t.shape.tolist()))) for t in reader.tensors}
    for name, value in change(tensors).items():
        writer.add_tensor(name, np.ascontiguousarray(value, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_older_qwen3_next_gguf_with_ssm_in_loads_the_same(tmp_path: Path):
    """Qwen3-Next files written before the converter split the projection hold Hugging Face's interleaved
    ``in_proj_qkvz`` whole as ``ssm_in`` (llama.cpp's legacy path views its rows as [q, k, v, z] per key
    head): the same model as the split attn_qkv / attn_gate."""
    path = TINY / "qwen3_next_all_moe" / "model.f32.gguf"
    config = load(str(path)).config
    hk, dk = config["linear_num_key_heads"], config["linear_key_head_dim"]

    def interleave(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out = dict(tensors)
        for name in [n for n in tensors if n.endswith("attn_gate.weight")]:
            block = name.removesuffix("attn_gate.weight")
            qkv, z = out.pop(block + "attn_qkv.weight"), out.pop(name)
            q, k, v = np.split(qkv, [hk * dk, 2 * hk * dk])
            groups = [x.reshape(hk, -1, x.shape[-1]) for x in (q, k, v, z)]
            out[block + "ssm_in.weight"] = np.concatenate(groups, axis=1).reshape(-1, qkv.shape[-1])
        return out

    rewrite_gguf(path, tmp_path / "legacy.gguf", interleave)
    names = read_header(tmp_path / "legacy.gguf").tensors
    assert "blk.0.ssm_in.weight" in names and "blk.0.attn_qkv.weight" not in names
    tokens = np.load(TINY / "qwen3_next_all_moe" / "reference.npz")["tokens_0"]
    want = prefill_then_decode(load(str(path)).model, tokens)
    got = prefill_then_decode(load(str(tmp_path / "legacy.gguf")).model, tokens)
    np.testing.assert_array_equal(got, want)
