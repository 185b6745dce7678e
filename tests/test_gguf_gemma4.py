"""Gemma 4 GGUF files as llama.cpp's own converter writes them.

``model.f32.gguf`` in tests/oracle/tiny/gemma4_text and tests/oracle/tiny/gemma4 is the tiny checkpoint
converted by llama.cpp's convert_hf_to_gguf.py (tests/oracle/make_tiny_gguf.py): gemma4_text has
KV-shared layers with double-wide MLPs and per-layer inputs, gemma4 (the text model of the composite)
routed experts and global layers with fewer KV heads whose keys double as values; both have wider global
heads than sliding ones, a sliding-window pattern and proportional RoPE stored as ``rope_freqs``.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from mlx.utils import tree_flatten
from test_architectures import TOL, block_table, forward, new_cache

from mlx_infer.errors import UnsupportedArchitecture
from mlx_infer.interface.batch import SequenceSlice
from mlx_infer.loading import load
from mlx_infer.loading.gguf_config import hf_config
from mlx_infer.loading.gguf_file import read_header
from mlx_infer.plan import make_plan
from mlx_infer.plan.weights import read_metadata
from mlx_infer.tokenizer import Tokenizer

TINY = Path(__file__).parent / "oracle" / "tiny"
NAMES = ("gemma4_text", "gemma4")


def chunked_logits(model, tokens: np.ndarray) -> np.ndarray:
    """Every position's logits: prefill chunks crossing block edges, then single decode steps."""
    table, cache, done, rows = block_table(0, len(tokens)), new_cache(model), 0, []
    for n in [5, 6, len(tokens) - 19] + [1] * 8:
        rows.append(forward(model, cache, [SequenceSlice(table, done, n, True)], tokens[done : done + n]))
        done += n
    return np.concatenate(rows)


@pytest.mark.parametrize("name", NAMES)
def test_converted_gguf_gives_transformers_logits(name: str):
    folder = TINY / name
    ref = np.load(folder / "reference.npz")
    loaded = load(str(folder / "model.f32.gguf"))
    assert loaded.config["model_type"] == "gemma4_text"
    for i in range(2):
        err = np.abs(chunked_logits(loaded.model, ref[f"tokens_{i}"]) - ref[f"logits_{i}"]).max()
        assert err <= TOL, f"{name}: max |logit - transformers'| = {err:.2e}"


def test_per_layer_metadata_becomes_the_layers_shapes():
    """gemma4_text: sliding heads of 16 and global ones of 32 (rotating a quarter of their pairs), the
    two KV-shared layers' MLPs twice as wide, per-layer inputs of 8; gemma4: 2 KV heads on sliding
    layers and 1 on global ones without V projections, 4 experts of width 32."""
    text = load(str(TINY / "gemma4_text" / "model.f32.gguf"))
    args, layers = text.model.args, text.model.model.layers
    assert args.layer_types == ["sliding_attention", "full_attention"] * 3
    assert [a.self_attn.head_dim for a in layers] == [16, 32] * 3
    assert args.rope_parameters["full_attention"]["partial_rotary_factor"] == 0.25
    assert [layer.mlp.gate_proj.weight.shape[0] for layer in layers] == [96] * 4 + [192] * 2
    assert text.model.kv_sources == [0, 1, 2, 3, 2, 3]
    assert args.hidden_size_per_layer_input == 8 and args.sliding_window == 8

    moe = load(str(TINY / "gemma4" / "model.f32.gguf"))
    attn = [layer.self_attn for layer in moe.model.model.layers]
    assert [a.n_kv_heads for a in attn] == [2, 1, 2, 1]
    assert ["v_proj" in a for a in attn] == [True, False, True, False]
    experts = moe.model.model.layers[0].experts.switch_glu
    assert experts.gate_proj.weight.shape == experts.up_proj.weight.shape == (4, 32, 64)
    assert moe.model.args.hidden_size_per_layer_input == 0


@pytest.mark.parametrize("name", NAMES)
def test_plan_of_the_gguf_equals_what_load_holds(name: str):
    path = TINY / name / "model.f32.gguf"
    plan = make_plan(str(path), context=64, backend="cpu")
    held = sum(p.nbytes for _, p in tree_flatten(load(str(path)).model.parameters()))
    assert plan.weights_bytes == held
    # The KV-shared layers own no pools: the GGUF's plan counts the folder's bytes a token.
    folder = make_plan(str(TINY / name), context=64, backend="cpu")
    assert plan.kv_bytes_per_token == folder.kv_bytes_per_token


def read_fractions(name: str) -> dict[str, float]:
    tensors = read_metadata(str(TINY / name / "model.f32.gguf"), "cpu", None).tensors
    return {t.name: t.read_fraction for t in tensors}


def test_decode_reads_a_row_of_the_per_layer_table_and_top_k_of_the_experts():
    """The GGUF's plan reads what the folder's does: the per-layer table is a lookup, 2 of 4 experts run."""
    text, moe = read_fractions("gemma4_text"), read_fractions("gemma4")
    assert text["per_layer_token_embd.weight"] == 0.0 and text["per_layer_model_proj.weight"] == 1.0
    assert moe["blk.0.ffn_gate_up_exps.weight"] == 0.5 and moe["blk.0.ffn_gate.weight"] == 1.0
    assert moe["blk.0.ffn_down_exps.scale"] == 1.0  # the router's per-expert scale, read whole
    for name in NAMES:
        paths = (TINY / name, TINY / name / "model.f32.gguf")
        folder, gguf_file = (make_plan(str(p), context=64, backend="cpu") for p in paths)
        assert gguf_file.decode_tok_s_bound == pytest.approx(folder.decode_tok_s_bound, rel=1e-9)


def write_q8_0(source: Path, dest: Path, dequantized: bool = False) -> None:
    """``source`` again with every tensor whose rows Q8_0's 32-value blocks divide stored as Q8_0 (what
    llama-quantize does to the matrices), metadata unchanged; ``dequantized``: those tensors' Q8_0
    values stored back as float32 instead."""
    header = read_header(source)
    writer = gguf.GGUFWriter(str(dest), header.metadata["general.architecture"])
    types = {bool: gguf.GGUFValueType.BOOL, int: gguf.GGUFValueType.INT32,
             float: gguf.GGUFValueType.FLOAT32, str: gguf.GGUFValueType.STRING}  # fmt: skip
    for key, value in header.metadata.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        if isinstance(value, list):
            writer.add_key_value(key, value, gguf.GGUFValueType.ARRAY, sub_type=types[type(value[0])])
        else:
            writer.add_key_value(key, value, types[type(value)])
    q8_0 = gguf.GGMLQuantizationType.Q8_0
    for t in gguf.GGUFReader(source).tensors:
        data = np.array(t.data, dtype=np.float32)
        if data.ndim < 2 or data.shape[-1] % 32:
            writer.add_tensor(t.name, data)
        elif dequantized:
            writer.add_tensor(t.name, gguf.quants.dequantize(gguf.quants.quantize(data, q8_0), q8_0))
        else:
            writer.add_tensor(t.name, gguf.quants.quantize(data, q8_0), raw_dtype=q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_q8_0_gguf_splits_its_fused_experts_with_their_scales(tmp_path: Path):
    """mx.load reads Q8_0 as MLX 8-bit affine: the experts' fused gate/up blocks split with their scales
    and biases, and stay quantized; dequantized at load they are the Q8_0 values exactly (the logits of
    a float32 file of those values: a random tiny model amplifies any other difference to O(1))."""
    source = TINY / "gemma4" / "model.f32.gguf"
    write_q8_0(source, tmp_path / "q8.gguf")
    write_q8_0(source, tmp_path / "values.gguf", dequantized=True)
    kept = load(str(tmp_path / "q8.gguf"), keep_quantized=True).model
    glu = kept.model.layers[1].experts.switch_glu
    assert glu.gate_proj.bits == glu.up_proj.bits == 8 and glu.gate_proj.scales.shape == (4, 32, 2)
    held = sum(p.nbytes for _, p in tree_flatten(kept.parameters()))
    assert make_plan(str(tmp_path / "q8.gguf"), context=64, backend="cpu").weights_bytes == held
    tokens = np.load(TINY / "gemma4" / "reference.npz")["tokens_1"]
    got = chunked_logits(load(str(tmp_path / "q8.gguf"), keep_quantized=False).model, tokens)
    want = chunked_logits(load(str(tmp_path / "values.gguf")).model, tokens)
    assert np.abs(got - want).max() < 1e-4


def metadata_with(**changes) -> tuple[dict, dict]:
    """gemma4_text's GGUF metadata with ``changes`` (``attention__x``: the key ``gemma4.attention.x``)."""
    header = read_header(TINY / "gemma4_text" / "model.f32.gguf")
    changed = {f"gemma4.{k.replace('__', '.')}": v for k, v in changes.items()}
    return {**header.metadata, **changed}, header.tensors


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"feed_forward_length": [96, 96, 192, 96, 192, 192]}, "MLP widths"),
        ({"attention__head_count": [4, 4, 4, 4, 2, 2]}, "query head counts"),
        ({"attention__sliding_window_pattern": [True, False]}, "sliding_window_pattern"),
        ({"rope__dimension_count_swa": 8}, "RoPE over part of a head"),
    ],
)
def test_gemma4_layouts_the_model_cannot_run_are_refused(changes: dict, message: str):
    metadata, tensors = metadata_with(**changes)
    with pytest.raises(UnsupportedArchitecture, match=message):
        hf_config(metadata, tensors, "m.gguf")


def test_per_layer_arrays_are_refused_for_other_architectures():
    metadata, tensors = metadata_with(attention__head_count_kv=[2, 1, 2, 1, 2, 1])
    metadata = {k.replace("gemma4.", "qwen3."): v for k, v in metadata.items()}
    metadata["general.architecture"] = "qwen3"
    with pytest.raises(UnsupportedArchitecture, match="per-layer attention.head_count_kv"):
        hf_config(metadata, tensors, "m.gguf")


# ---- the gemma4 tokenizer ---------------------------------------------------------------------------
VOCAB = Path(__file__).parent / "oracle" / "gemma4_tokenizer"


@pytest.fixture(scope="module")
def gemma4_tokenizer() -> Tokenizer:
    """A vocabulary of Gemma 4's kind written by llama.cpp's converter (oracle/make_gemma4_tokenizer.py)."""
    return Tokenizer.from_gguf_metadata(read_header(VOCAB / "vocab.gguf").metadata)


@pytest.mark.parametrize("case", range(10))
def test_gemma4_vocabulary_tokenizes_as_llama_cpp(gemma4_tokenizer: Tokenizer, case: int):
    """llama.cpp's own ids (with the BOS the file asks for): spaces as ``▁``, newline runs whole where the
    vocabulary has them (a run of 7 it lacks is cut by the merges), bytes outside the vocabulary as
    ``<0xXX>``, special and user-defined tokens whole; decoding gives the text back."""
    text, want = json.loads((VOCAB / "llama_cpp_ids.json").read_text())[case]
    ids = gemma4_tokenizer.encode(text)
    assert ids == want
    assert gemma4_tokenizer.decode(ids[1:]) == text


def test_gemma4_vocabulary_ends_turns_and_hides_only_control_tokens(gemma4_tokenizer: Tokenizer):
    vocab = gemma4_tokenizer.backend.get_vocab()
    assert {vocab["<eos>"], vocab["<turn|>"], vocab["<|tool_response>"]} <= gemma4_tokenizer.eos_token_ids
    ids = gemma4_tokenizer.encode("<|turn>model\n<|channel>hi<channel|><turn|>", add_special_tokens=False)
    # <|channel> is user-defined in the file (the converter keeps it visible for the chat parser).
    assert gemma4_tokenizer.decode(ids, skip_special_tokens=True) == "model\n<|channel>hi<channel|>"
