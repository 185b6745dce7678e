"""mlx_infer.loading: HF folders (single / sharded), mlx-community quantized folders, Hub cache, GGUF.

Oracles: the in-memory model that wrote a folder; for GGUF, tensors dequantized by the ``gguf`` package
(llama.cpp's own Python code) with llama.cpp's row permutation applied or undone here in NumPy, and the
same weights loaded from a Hugging Face folder; ``gguf.TensorNameMap`` for the name mapping.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_LLAMA_CONFIG, TINY_WORDS, make_tiny_llama, write_hf_folder
from emulated import metal_kernels_emulated
from gguf.constants import MODEL_ARCH_NAMES, GGMLQuantizationType
from mlx.utils import tree_flatten, tree_unflatten

from mlx_infer import cpu_kernels
from mlx_infer.errors import InvalidCheckpoint, ModelNotFound, UnsupportedArchitecture
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import load, policy
from mlx_infer.loading.build import build_model
from mlx_infer.loading.gguf import gguf_to_hf_names
from mlx_infer.loading.gguf_config import MODEL_TYPES, llama3_scaling
from mlx_infer.loading.gguf_file import read_header, tensor_bytes
from mlx_infer.metal_kernels.emulator import toolchain_available
from mlx_infer.metal_kernels.layers import GGUFEmbedding, GGUFLinear, KernelQuantizedLinear
from mlx_infer.models.base import rope_frequencies

Q = GGMLQuantizationType
TOKENS = [1, 5, 17, 42, 8, 33, 60, 2, 9, 11]


def all_logits(model: nn.Module, tokens: list[int] = TOKENS) -> np.ndarray:
    """Float32 logits of every position of one uncached forward."""
    bs = 16
    blocks = -(-len(tokens) // bs)
    cache = new_cache(model, blocks, bs, mx.float32)
    meta = build_metadata([SequenceSlice(list(range(blocks)), 0, len(tokens), want_all_logits=True)], bs)
    return np.array(model(mx.array(tokens), cache, meta).astype(mx.float32))


def assert_one_line_error(excinfo: pytest.ExceptionInfo) -> None:
    message = str(excinfo.value)
    assert message and "\n" not in message, message


# ---------------------------------------------------------------- Hugging Face folders


def test_hf_folder_single_file(tiny_llama_folder: Path):
    loaded = load(str(tiny_llama_folder))
    assert loaded.max_context == TINY_LLAMA_CONFIG["max_position_embeddings"]
    assert loaded.config["model_type"] == "llama" and loaded.source == str(tiny_llama_folder)
    np.testing.assert_array_equal(all_logits(loaded.model), all_logits(make_tiny_llama(0)))


def test_hf_folder_sharded_same_logits(tiny_llama_folder: Path, tmp_path: Path):
    weights = mx.load(str(tiny_llama_folder / "model.safetensors"))
    sharded = tmp_path / "sharded"
    shutil.copytree(tiny_llama_folder, sharded)
    (sharded / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        mx.save_safetensors(str(sharded / file), {k: weights[k] for k in keys})
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (sharded / "model.safetensors.index.json").write_text(json.dumps(index))
    expected = all_logits(load(str(tiny_llama_folder)).model)
    np.testing.assert_array_equal(all_logits(load(str(sharded)).model), expected)


def test_bfloat16_folder_is_widened_on_cpu(tmp_path: Path):
    model = make_tiny_llama(1)
    weights = {k: v.astype(mx.bfloat16) for k, v in tree_flatten(model.parameters())}
    loaded = load(str(write_hf_folder(tmp_path / "bf16", weights, TINY_LLAMA_CONFIG)))
    assert {p.dtype for _, p in tree_flatten(loaded.model.parameters())} == {mx.float32}
    assert "from bfloat16" in loaded.weight_policy
    model.update(tree_unflatten([(k, v.astype(mx.float32)) for k, v in weights.items()]))
    np.testing.assert_array_equal(all_logits(loaded.model), all_logits(model))


# ---------------------------------------------------------------- mlx-community quantized folders


def _quantized_tiny(tmp_path: Path) -> tuple[Path, nn.Module]:
    model = make_tiny_llama(2)

    def predicate(path: str, module: nn.Module):
        if path == "lm_head":
            return {"group_size": 32, "bits": 8}
        return hasattr(module, "to_quantized")

    nn.quantize(model, group_size=64, bits=4, class_predicate=predicate)
    quantization = {"group_size": 64, "bits": 4, "lm_head": {"group_size": 32, "bits": 8}}
    config = {**TINY_LLAMA_CONFIG, "quantization": quantization}
    folder = write_hf_folder(tmp_path / "q4", dict(tree_flatten(model.parameters())), config)
    return folder, model


def test_float16_scales_stay_float16_for_the_cpu_kernels(tmp_path: Path):
    """A half-precision checkpoint's float16 scales and biases are kept as they are (the kernels widen them
    as they read them) while everything else is widened: the logits of MLX's own layers over the same
    values in float32, and embedding lookups that come out float32."""
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    model = make_tiny_llama(3)
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=32, bits=4)
    config = {**TINY_LLAMA_CONFIG, "quantization": {"group_size": 32, "bits": 4}, "torch_dtype": "float16"}
    folder = write_hf_folder(tmp_path / "q4-f16", dict(tree_flatten(model.parameters())), config)
    loaded = load(str(folder))
    assert "kept 4-bit for the native CPU kernels" in loaded.weight_policy
    embed = loaded.model.model.embed_tokens
    q = loaded.model.layers[0].self_attn.q_proj
    assert embed.scales.dtype == q.scales.dtype == q.biases.dtype == mx.float16
    assert loaded.model.layers[0].input_layernorm.weight.dtype == mx.float32
    assert embed(mx.array([3, 5])).dtype == mx.float32
    model.set_dtype(mx.float32)  # MLX's layers over the same values, computed in float32
    np.testing.assert_allclose(all_logits(loaded.model), all_logits(model), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("keep_quantized", [None, True])
def test_quantized_folder_kept_quantized_for_the_cpu_kernels(tmp_path: Path, keep_quantized: bool | None):
    """On the CPU backend with the native kernels, quantized layers stay quantized (by default too) and
    compute through the kernels: the same logits as MLX's own quantized layers, up to summation order."""
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    folder, model = _quantized_tiny(tmp_path)
    loaded = load(str(folder), keep_quantized=keep_quantized)
    assert "kept 4-bit/8-bit for the native CPU kernels" in loaded.weight_policy
    head = loaded.model.lm_head
    assert type(head) is KernelQuantizedLinear and (head.bits, head.group_size) == (8, 32)
    q = loaded.model.layers[0].self_attn.q_proj  # also a member of the fused q/k/v product (models/fused.py)
    assert isinstance(q, KernelQuantizedLinear) and (q.bits, q.group_size) == (4, 64)
    np.testing.assert_allclose(all_logits(loaded.model), all_logits(model), rtol=1e-4, atol=1e-4)


def test_quantized_folder_kept_as_mlx_layers_without_the_cpu_kernels(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    monkeypatch.setattr(cpu_kernels, "available", lambda: False)
    folder, model = _quantized_tiny(tmp_path)
    kept = load(str(folder), keep_quantized=True)
    assert type(kept.model.layers[0].self_attn.q_proj) is nn.QuantizedLinear
    np.testing.assert_array_equal(all_logits(kept.model), all_logits(model))
    dequantized = load(str(folder))  # the default without kernels: float32 for the BLAS
    assert "dequantized from 4-bit/8-bit" in dequantized.weight_policy
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in dequantized.model.named_modules())


def test_quantized_folder_dequantized_on_request(tmp_path: Path):
    folder, model = _quantized_tiny(tmp_path)
    loaded = load(str(folder), keep_quantized=False)
    assert not any(isinstance(m, nn.QuantizedLinear) for _, m in loaded.model.named_modules())
    assert "dequantized from 4-bit/8-bit" in loaded.weight_policy
    np.testing.assert_allclose(all_logits(loaded.model), all_logits(model), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- Hub cache


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    import huggingface_hub.constants as hf_constants

    cache = tmp_path / "hub-cache"
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(hf_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hf_constants, "HF_HUB_CACHE", str(cache))
    return cache


def test_hub_repo_id_from_offline_cache(tiny_llama_folder: Path, offline_hub: Path):
    revision = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--tiny-org--tiny-llama"
    shutil.copytree(tiny_llama_folder, repo / "snapshots" / revision)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    loaded = load("tiny-org/tiny-llama")
    assert Path(loaded.source) == repo / "snapshots" / revision
    np.testing.assert_array_equal(all_logits(loaded.model), all_logits(make_tiny_llama(0)))


def test_hub_unknown_repo_offline(offline_hub: Path):
    with pytest.raises(ModelNotFound) as excinfo:
        load("no-such-org/no-such-model")
    assert_one_line_error(excinfo)


# ---------------------------------------------------------------- GGUF: name mapping


@pytest.mark.parametrize("arch", sorted(MODEL_TYPES))
def test_gguf_names_agree_with_llama_cpp_tensor_map(arch: str):
    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    tensor_map = gguf.get_tensor_name_map(arch_enum, 2)
    names = gguf_to_hf_names(arch, 2)
    assert "blk.1.attn_q" in names and "token_embd" in names
    for gguf_name, hf in names.items():
        if "switch_mlp" in hf:  # our stacked-experts name; llama.cpp's map knows HF's per-expert names
            hf = hf.replace("switch_mlp", "experts")
        assert tensor_map.get_name(hf) == gguf_name, (hf, gguf_name)


def test_llama3_rope_factors_round_trip():
    """llama.cpp stores Llama 3.x RoPE scaling only as per-frequency factors (rope_freqs)."""
    scaling = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    head_dim, theta = 64, 500000.0
    plain = theta ** (np.arange(0, head_dim, 2) / head_dim)
    factors = np.array(rope_frequencies(head_dim, theta, scaling)) / plain
    recovered = llama3_scaling(factors.astype(np.float32), theta, head_dim)
    assert recovered is not None and recovered["factor"] == pytest.approx(32.0)
    assert llama3_scaling(factors[::-1].copy(), theta, head_dim) is None


# ---------------------------------------------------------------- GGUF: tiny files written here


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py's LlamaModel.permute (applied to Q and K rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, config: dict, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    """``tensors``: Hugging Face name -> (HF-layout array or raw GGUF bytes, type)."""
    tensor_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(TINY_WORDS)
    writer.add_token_types([3, 3, 3] + [1] * (len(TINY_WORDS) - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for hf_name, (data, qtype) in tensors.items():
        base = hf_name.removesuffix(".weight")
        if base.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"]
            data = llama_cpp_permute(data, heads)
        writer.add_tensor(f"{tensor_map.get_name(base)}.weight", data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_gguf_mx_load_types_match_hf_folder(tmp_path: Path):
    """Q8_0 / Q4_0 / Q4_1 / F16 / F32 tensors (the mx.load path) give the logits of the same values in HF."""
    cycle = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16]
    tensors, exact = {}, {}
    for i, (name, p) in enumerate(tree_flatten(make_tiny_llama(3).parameters())):
        w = np.array(p)
        qtype = cycle[i % len(cycle)] if w.ndim == 2 else Q.F32
        data = gguf.quants.quantize(w, qtype) if qtype != Q.F32 else w
        tensors[name] = (data, qtype)
        exact[name] = mx.array(gguf.quants.dequantize(data, qtype).reshape(w.shape))
    write_tiny_gguf(tmp_path / "tiny.gguf", TINY_LLAMA_CONFIG, tensors)
    hf = load(str(write_hf_folder(tmp_path / "hf", exact, TINY_LLAMA_CONFIG)))
    kept = load(str(tmp_path / "tiny.gguf"), keep_quantized=True)
    assert isinstance(kept.model.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    dequantized = load(str(tmp_path / "tiny.gguf"), keep_quantized=False)
    assert dequantized.config["tie_word_embeddings"] is False
    for name, value in tree_flatten(dequantized.model.parameters()):
        np.testing.assert_allclose(np.array(value), np.array(exact[name]), rtol=1e-6, atol=1e-7, err_msg=name)
    reference = all_logits(hf.model)
    np.testing.assert_allclose(all_logits(dequantized.model), reference, rtol=1e-5, atol=1e-5)
    # Kept quantized, MLX computes with float16 scales: close, not equal.
    np.testing.assert_allclose(all_logits(kept.model), reference, rtol=2e-2, atol=2e-2)


def random_k_quant(qtype: Q, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Valid K-quant bytes (gguf.quants cannot quantize to K-quants): random codes, small fp16 scales."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (rows, cols // block_size, type_size), dtype=np.uint8)
    if qtype == Q.Q6_K:
        blocks[..., 208:210] = np.frombuffer(np.float16(2e-4).tobytes(), np.uint8)  # d; int8 scales random
    else:  # Q4_K, Q5_K
        blocks[..., 0:2] = np.frombuffer(np.float16(2e-3).tobytes(), np.uint8)  # d
        blocks[..., 2:4] = np.frombuffer(np.float16(1e-3).tobytes(), np.uint8)  # dmin
    return blocks.reshape(rows, -1)


def test_gguf_k_quant_and_bf16_dequantized_exactly(tmp_path: Path):
    config = {**TINY_LLAMA_CONFIG, "hidden_size": 256, "intermediate_size": 512}  # K-quant rows: 256 values
    rng = np.random.default_rng(0)
    tensors, exact = {}, {}
    for i, (name, p) in enumerate(tree_flatten(make_tiny_llama(4, **config).parameters())):
        w = np.array(p)
        if w.ndim == 1:
            data, qtype = w, Q.F32
        elif "proj" in name and i % 2 == 0:
            data, qtype = random_k_quant(Q.Q4_K, *w.shape, rng), Q.Q4_K
        else:
            qtype = Q.BF16 if "proj" in name else Q.Q8_0
            data = gguf.quants.quantize(w, qtype)
        tensors[name] = (data, qtype)
        exact[name] = mx.array(gguf.quants.dequantize(data, qtype).reshape(w.shape))
    assert any(q == Q.Q4_K for _, q in tensors.values()) and any(q == Q.BF16 for _, q in tensors.values())
    write_tiny_gguf(tmp_path / "kq.gguf", config, tensors)
    loaded = load(str(tmp_path / "kq.gguf"))
    for name, value in tree_flatten(loaded.model.parameters()):
        np.testing.assert_array_equal(np.array(value), np.array(exact[name]), err_msg=name)
    hf = load(str(write_hf_folder(tmp_path / "hf", exact, config)))
    np.testing.assert_allclose(all_logits(loaded.model), all_logits(hf.model), rtol=1e-5, atol=1e-5)


def test_metal_policy_requantizes_k_quant_weights(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(policy, "cpu_backend", lambda: False)
    model = make_tiny_llama(5)
    description = policy.apply_weight_policy(model, None, {"model.layers.0.mlp.down_proj": 4, "lm_head": 8})
    assert "re-quantized to 4-bit/8-bit" in description
    down, head = model.layers[0].mlp.down_proj, model.lm_head
    assert isinstance(down, nn.QuantizedLinear) and down.bits == 4
    assert isinstance(head, nn.QuantizedLinear) and head.bits == 8
    assert not isinstance(model.layers[0].mlp.up_proj, nn.QuantizedLinear)


@pytest.mark.skipif(not toolchain_available(), reason="the emulator needs `pip install ziglang`")
def test_gguf_k_quants_stay_blocks_on_metal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """On Metal with the kernels, Q4_K/Q5_K/Q6_K matrices load as their raw blocks (Q/K rows unpermuted)
    into GGUF layers, and the emulated K-quant kernels give the logits of the dequantized CPU load."""
    config = {**TINY_LLAMA_CONFIG, "hidden_size": 256, "intermediate_size": 512, "tie_word_embeddings": True}
    rng = np.random.default_rng(1)
    kinds = [Q.Q4_K, Q.Q5_K, Q.Q6_K]
    tensors = {}
    for i, (name, p) in enumerate(tree_flatten(make_tiny_llama(7, **config).parameters())):
        w, kind = np.array(p), kinds[i % 3]
        tensors[name] = (random_k_quant(kind, *w.shape, rng), kind) if w.ndim == 2 else (w, Q.F32)
    write_tiny_gguf(tmp_path / "kq.gguf", config, tensors)
    dequantized = load(str(tmp_path / "kq.gguf"))  # the CPU path: float32

    monkeypatch.setattr(policy, "cpu_backend", lambda: False)
    with metal_kernels_emulated() as launched:
        blocks = load(str(tmp_path / "kq.gguf"))
        assert "GGUF Q4_K/Q5_K/Q6_K kept as blocks" in blocks.weight_policy
        modules = dict(blocks.model.named_modules())
        params = dict(tree_flatten(blocks.model.parameters()))
        for name, (data, qtype) in tensors.items():
            if qtype != Q.F32:
                layer = modules[name.removesuffix(".weight")]
                assert isinstance(layer, (GGUFLinear, GGUFEmbedding)) and layer.kind == qtype.name, name
                np.testing.assert_array_equal(np.array(params[name]), data, err_msg=name)
        assert isinstance(blocks.model.model.embed_tokens, GGUFEmbedding)  # and the tied head
        tokens = TOKENS[:6]  # up to 8 rows: every projection is a matvec kernel launch
        expect = all_logits(dequantized.model, tokens)
        got = all_logits(blocks.model, tokens)
    assert {"q4_k_qmv", "q5_k_qmv", "q6_k_qmv", "paged_attention"} <= set(launched)
    np.testing.assert_allclose(got, expect, rtol=1e-4, atol=1e-4 * np.abs(expect).max())


# ---------------------------------------------------------------- GGUF: the real SmolLM2 file


def test_smollm2_gguf_matches_gguf_oracle(smollm2_path: Path):
    loaded = load(str(smollm2_path), keep_quantized=False)
    cfg = loaded.config
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_key_value_heads"]) == (30, 576, 3)
    assert loaded.max_context == 8192 and "float32" in loaded.weight_policy
    # Raw Q4_1 bytes located by our header reader (an error there would show as a mismatch with mx.load),
    # dequantized by llama.cpp's gguf package; gguf.GGUFReader would do the same in ~15 s.
    header = read_header(smollm2_path)
    attn = loaded.model.layers[7].self_attn
    for proj, heads in (("q", 9), ("k", 3)):
        info = header.tensors[f"blk.7.attn_{proj}.weight"]
        assert info.qtype == Q.Q4_1
        w = gguf.quants.dequantize(np.array(tensor_bytes(smollm2_path, info)), info.qtype)
        # Inverse of llama.cpp's permute: rows (head, pair, 2) -> (head, 2, pair).
        hf = w.reshape(heads, w.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)
        np.testing.assert_allclose(np.array(getattr(attn, f"{proj}_proj").weight), hf, rtol=1e-6, atol=1e-7)

    kept = load(str(smollm2_path), keep_quantized=True)
    q = kept.model.layers[7].self_attn.q_proj
    assert isinstance(q, nn.QuantizedLinear) and (q.bits, q.group_size) == (4, 32)
    tokens = loaded.tokenizer.encode("The capital of France is")
    f32, quant = all_logits(loaded.model, tokens), all_logits(kept.model, tokens)
    # Kept quantized, MLX accumulates with float16 scales: close to the float32 model, not equal.
    np.testing.assert_allclose(quant, f32, atol=0.25)
    paris = loaded.tokenizer.encode(" Paris", add_special_tokens=False)
    assert int(f32[-1].argmax()) == int(quant[-1].argmax()) == paris[0]


# ---------------------------------------------------------------- errors


def test_missing_path():
    with pytest.raises(ModelNotFound) as excinfo:
        load("/no/such/model.gguf")
    assert_one_line_error(excinfo)


def test_truncated_safetensors(tiny_llama_folder: Path):
    weights = tiny_llama_folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(InvalidCheckpoint) as excinfo:
        load(str(tiny_llama_folder))
    assert_one_line_error(excinfo)


def test_truncated_gguf(tmp_path: Path):
    tensors = {n: (np.array(p), Q.F32) for n, p in tree_flatten(make_tiny_llama(6).parameters())}
    write_tiny_gguf(tmp_path / "t.gguf", TINY_LLAMA_CONFIG, tensors)
    data = (tmp_path / "t.gguf").read_bytes()
    for cut in (len(data) // 2, 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(InvalidCheckpoint) as excinfo:
            load(str(tmp_path / "cut.gguf"))
        assert_one_line_error(excinfo)


@pytest.mark.parametrize("damage", ["wrong_dtype", "missing_tensor", "wrong_shape"])
def test_damaged_weights(tiny_llama_folder: Path, damage: str):
    path = tiny_llama_folder / "model.safetensors"
    weights = dict(mx.load(str(path)))
    name = "model.layers.1.self_attn.q_proj.weight"
    if damage == "wrong_dtype":
        weights[name] = weights[name].astype(mx.int32)
    elif damage == "missing_tensor":
        del weights[name]
    else:
        weights[name] = weights[name][:8]
    mx.save_safetensors(str(path), weights)
    with pytest.raises(InvalidCheckpoint) as excinfo:
        load(str(tiny_llama_folder))
    assert_one_line_error(excinfo)
    assert "q_proj" in str(excinfo.value)


def test_unknown_architecture(tiny_llama_folder: Path, tmp_path: Path):
    config = json.loads((tiny_llama_folder / "config.json").read_text())
    (tiny_llama_folder / "config.json").write_text(json.dumps({**config, "model_type": "mamba"}))
    with pytest.raises(UnsupportedArchitecture) as excinfo:
        load(str(tiny_llama_folder))
    assert_one_line_error(excinfo)
    writer = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedArchitecture) as excinfo:
        load(str(tmp_path / "m.gguf"))
    assert_one_line_error(excinfo)


def test_building_models_again_and_again_holds_no_memory():
    # A server that swaps models builds one per load: each layer's random initial weights (replaced
    # unevaluated) split MLX's global random key, whose lazy graph kept every split (~0.4 MiB a build
    # of this 32-layer model) until build_model evaluated the key.
    config = {**TINY_LLAMA_CONFIG, "num_hidden_layers": 32}
    weights = dict(tree_flatten(make_tiny_llama(0, num_hidden_layers=32).parameters()))
    mx.eval(weights)

    def resident() -> int:
        return int(Path("/proc/self/statm").read_text().split()[1]) * 4096

    for _ in range(50):  # allocator pools settle
        build_model(config, dict(weights), "tiny")
    before = resident()
    for _ in range(250):
        build_model(config, dict(weights), "tiny")
    assert resident() - before < 20 * 2**20
