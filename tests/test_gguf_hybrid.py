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
from gguf.constants import GGMLQuantizationType as Q
from gguf.quants import dequantize
from mlx.utils import tree_flatten
from test_loading import random_k_quant

from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import load
from mlx_infer.loading.gguf import read_gguf
from mlx_infer.loading.gguf_file import read_header
from mlx_infer.loading.gguf_hybrid import untile
from mlx_infer.metal_kernels import dispatch
from mlx_infer.plan import make_plan
from mlx_infer.plan.weights import read_metadata

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
    cache = new_cache(model, n_blocks, BLOCK, mx.float32, num_state_slots=1)
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


# A Qwen3.5 DeltaNet layer large enough for quantized rows: 2 key heads, 4 value heads of 64.
HIDDEN, HK, HV, DK, DV, FFN = 256, 2, 4, 64, 64, 256
CONV = 2 * HK * DK + HV * DV


def write_qwen35_layer(path: Path, qtypes: dict[str, Q], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """A one-layer qwen35 GGUF (no attention layer; enough for read_gguf and the plan) whose matrices have
    the given types; returns their stored bytes."""
    shapes = {"attn_qkv": (CONV, HIDDEN), "attn_gate": (HV * DV, HIDDEN), "ssm_beta": (HV, HIDDEN),
              "ssm_alpha": (HV, HIDDEN), "ssm_out": (HIDDEN, HV * DV), "ffn_gate": (FFN, HIDDEN),
              "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}  # fmt: skip
    writer = gguf.GGUFWriter(str(path), "qwen35")
    for key, value in {"block_count": 1, "context_length": 64, "embedding_length": HIDDEN,
                       "feed_forward_length": FFN, "attention.head_count": 2, "attention.head_count_kv": 1,
                       "attention.key_length": 64, "attention.value_length": 64, "rope.dimension_count": 16,
                       "ssm.conv_kernel": 4, "ssm.state_size": DK, "ssm.group_count": HK,
                       "ssm.time_step_rank": HV, "ssm.inner_size": HV * DV}.items():  # fmt: skip
        writer.add_uint32(f"qwen35.{key}", value)
    writer.add_float32("qwen35.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_array("qwen35.attention.recurrent_layers", [True])
    raw = {}
    for name, (rows, cols) in shapes.items():
        qtype = qtypes[name]
        if qtype in (Q.Q4_K, Q.Q6_K):
            raw[name] = random_k_quant(qtype, rows, cols, rng)
        else:
            raw[name] = gguf.quants.quantize(rng.standard_normal((rows, cols), np.float32) / 16, qtype)
        writer.add_tensor(f"blk.0.{name}.weight", raw[name], raw_dtype=qtype)
    vectors = {"token_embd.weight": (128, HIDDEN), "output_norm.weight": (HIDDEN,),
               "blk.0.attn_norm.weight": (HIDDEN,), "blk.0.post_attention_norm.weight": (HIDDEN,),
               "blk.0.ssm_a": (HV,), "blk.0.ssm_dt.bias": (HV,), "blk.0.ssm_conv1d.weight": (CONV, 4),
               "blk.0.ssm_norm.weight": (DV,)}  # fmt: skip
    for name, shape in vectors.items():
        writer.add_tensor(name, -np.abs(rng.standard_normal(shape, np.float32)) - 0.1)  # ssm_a < 0
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return raw


def test_qwen35_k_quant_blocks_move_by_rows_and_ssm_out_is_decoded(tmp_path: Path, monkeypatch):
    """Where K-quant matrices stay raw blocks (Metal), the value-head reordering moves whole rows of blocks
    (in_proj_qkv's v rows, in_proj_z, in_proj_b/a); ssm_out's columns move by head (64 values here, 128 in
    Qwen3.5), inside a 256-value block, so it is read dequantized (and re-quantized), and the plan says so."""
    qtypes = {name: Q.Q6_K if name in ("ssm_beta", "ssm_alpha", "ffn_down") else Q.Q4_K
              for name in ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ffn_gate", "ffn_up",
                           "ffn_down")}  # fmt: skip
    raw = write_qwen35_layer(tmp_path / "kq.gguf", qtypes, np.random.default_rng(3))

    blocks = read_gguf(tmp_path / "kq.gguf", kquant_blocks=True)
    decoded = read_gguf(tmp_path / "kq.gguf")
    p = "model.layers.0.linear_attn."
    assert blocks.kquants[p + "in_proj_z"] == "Q4_K" and blocks.kquants[p + "in_proj_b"] == "Q6_K"
    np.testing.assert_array_equal(np.array(blocks.weights[p + "in_proj_z.weight"]),
                                  np.array(untile(mx.array(raw["attn_gate"]), HK, HV)))
    for name, qtype in [("in_proj_qkv", Q.Q4_K), ("in_proj_z", Q.Q4_K), ("in_proj_a", Q.Q6_K)]:
        rows = np.array(blocks.weights[p + name + ".weight"])  # the blocks, decoded: the CPU read's values
        want = np.array(decoded.weights[p + name + ".weight"])
        np.testing.assert_array_equal(dequantize(rows, qtype), want)
    assert p + "out_proj" not in blocks.kquants and blocks.requantize[p + "out_proj"] == 4
    want = untile(mx.array(dequantize(raw["ssm_out"], Q.Q4_K)), HK, HV, axis=-1)
    np.testing.assert_array_equal(np.array(blocks.weights[p + "out_proj.weight"]), np.array(want))

    monkeypatch.setattr(dispatch, "USE_KERNELS", True)
    planned = {t.name: t for t in read_metadata(str(tmp_path / "kq.gguf"), "metal", None).tensors}
    assert planned["blk.0.attn_gate.weight"].gguf_bytes > 0
    assert planned["blk.0.ssm_out.weight"].gguf_bytes == 0 and planned["blk.0.ssm_out.weight"].requantize == 4


def fuse_as_the_converter_does(tensors: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """convert_hf_to_gguf.py's --fuse-qkv (a full-attention layer's q, k, v rows into attn_qkv) and
    --fuse-gate-up-exps (each expert's gate rows, then its up rows, into ffn_gate_up_exps)."""
    out = dict(tensors)
    for name in [n for n in tensors if n.endswith("attn_q.weight")]:
        block = name.removesuffix("attn_q.weight")
        parts = [out.pop(block + f"attn_{x}.weight") for x in "qkv"]
        out[block + "attn_qkv.weight"] = np.concatenate(parts)
    for name in [n for n in tensors if n.endswith("ffn_gate_exps.weight")]:
        block = name.removesuffix("ffn_gate_exps.weight")
        gate, up = out.pop(name), out.pop(block + "ffn_up_exps.weight")
        out[block + "ffn_gate_up_exps.weight"] = np.concatenate([gate, up], axis=1)
    return out


def test_gguf_with_the_converters_fused_qkv_and_gate_up_loads_the_same(tmp_path: Path):
    path = TINY / "qwen3_5_moe" / "model.f32.gguf"
    rewrite_gguf(path, tmp_path / "fused.gguf", fuse_as_the_converter_does)
    names = read_header(tmp_path / "fused.gguf").tensors
    assert "blk.1.attn_qkv.weight" in names and "blk.1.attn_q.weight" not in names
    assert "blk.0.ffn_gate_up_exps.weight" in names
    tokens = np.load(TINY / "qwen3_5_moe" / "reference.npz")["tokens_0"]
    want = prefill_then_decode(load(str(path)).model, tokens)
    np.testing.assert_array_equal(prefill_then_decode(load(str(tmp_path / "fused.gguf")).model, tokens), want)


def test_qwen35_q8_0_value_heads_move_with_their_scales(tmp_path: Path):
    """Q8_0 loads as MLX affine words, scales and biases (group 32): the value-head reordering moves their
    rows, and out_proj's columns a head (64 values: 2 groups, 16 words) at a time, values intact."""
    names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ffn_gate", "ffn_up", "ffn_down")
    raw = write_qwen35_layer(tmp_path / "q8.gguf", dict.fromkeys(names, Q.Q8_0), np.random.default_rng(4))
    weights = read_gguf(tmp_path / "q8.gguf").weights
    p = "model.layers.0.linear_attn."

    def values(module: str) -> np.ndarray:
        w, s, b = (weights[f"{p}{module}.{x}"] for x in ("weight", "scales", "biases"))
        return np.array(mx.dequantize(w, s.astype(mx.float32), b.astype(mx.float32), group_size=32, bits=8))

    def stored(name: str) -> mx.array:
        return mx.array(dequantize(raw[name], Q.Q8_0))

    def same(got: np.ndarray, want: mx.array) -> None:  # up to the rounding of s * (q + 128) - 128 * s
        np.testing.assert_allclose(got, np.array(want), rtol=0, atol=1e-6)

    same(values("out_proj"), untile(stored("ssm_out"), HK, HV, axis=-1))
    same(values("in_proj_z"), untile(stored("attn_gate"), HK, HV))
    qkv = stored("attn_qkv")
    same(values("in_proj_qkv"), mx.concatenate([qkv[: 2 * HK * DK], untile(qkv[2 * HK * DK :], HK, HV)]))


def test_plan_of_a_model_without_attention_layers(tmp_path: Path):
    """No layer keeps K/V (0 B a token): the plan counts the recurrent states, not a division by zero, and
    the sequences that fit are bounded by the states."""
    path = tmp_path / "recurrent.gguf"
    names = ("attn_qkv", "attn_gate", "ssm_beta", "ssm_alpha", "ssm_out", "ffn_gate", "ffn_up", "ffn_down")
    write_qwen35_layer(path, dict.fromkeys(names, Q.Q8_0), np.random.default_rng(0))
    plan = make_plan(str(path), context=64, max_num_seqs=2)
    assert plan.kv_bytes_per_token == 0 and plan.kv_bytes == 0 and plan.state_bytes > 0
    assert plan.fits and plan.max_context_that_fits == plan.model_max_context
    per_sequence = plan.state_bytes // 2
    left = plan.budget_bytes - plan.weights_bytes
    assert 2 < plan.max_num_seqs_that_fit <= left // per_sequence
