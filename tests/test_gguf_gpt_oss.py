"""gpt-oss from a GGUF file as llama.cpp's converter writes it: the tiny MXFP4 checkpoint converted the
way ``convert_hf_to_gguf.py``'s GptOssModel does (names, gate/up split, MXFP4 blocks re-laid into ggml's
nibble order), written with the ``gguf`` package; its logits must be transformers' and its experts the
very bits of the Hugging Face folder."""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
from gguf.constants import GGMLQuantizationType as Q
from test_architectures import TOL, block_table, forward, new_cache

from mlx_infer.interface.batch import SequenceSlice
from mlx_infer.loading import hf, load
from mlx_infer.models.gpt_oss import clamped_swiglu

FOLDER = Path(__file__).parent / "oracle" / "tiny" / "gpt_oss_mxfp4"
LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.router": "ffn_gate_inp",
}  # fmt: skip
TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def ggml_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """HF MXFP4 ([..., groups, 16] bytes, values 2j and 2j + 1 in byte j) -> ggml's 17-byte blocks
    (exponent, then values j and j + 16 in byte j), flattened per row (llama.cpp's repack_mxfp4)."""
    codes = np.stack([blocks & 0x0F, blocks >> 4], axis=-1).reshape(*blocks.shape[:-1], 32)
    qs = codes[..., :16] | (codes[..., 16:] << 4)
    return np.concatenate([scales[..., None], qs], axis=-1).reshape(*blocks.shape[:2], -1).astype(np.uint8)


def write_gguf(path: Path) -> None:
    config = hf.read_config(FOLDER)
    n_layers = config["num_hidden_layers"]
    writer = gguf.GGUFWriter(str(path), "gpt-oss")
    writer.add_block_count(n_layers)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    rope = config["rope_parameters"]
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_expert_count(config["num_local_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_sliding_window(config["sliding_window"])
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"w{i}" for i in range(config["vocab_size"])])
    writer.add_token_types([3, 3, 3] + [1] * (config["vocab_size"] - 3))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    weights = {k: np.array(v) for k, v in hf.read_weights(FOLDER).items()}
    for i in range(n_layers):
        blk = f"blk.{i}."
        layer = {k.rpartition(".")[2]: weights.pop(k) for k in list(weights) if f".{i}.mlp.experts." in k}
        blocks, scales = layer["gate_up_proj_blocks"], layer["gate_up_proj_scales"]
        bias = layer["gate_up_proj_bias"]
        for kind, rows in (("gate", slice(0, None, 2)), ("up", slice(1, None, 2))):
            writer.add_tensor(f"{blk}ffn_{kind}_exps.weight", ggml_mxfp4(blocks[:, rows], scales[:, rows]),
                              raw_dtype=Q.MXFP4)
            writer.add_tensor(f"{blk}ffn_{kind}_exps.bias", bias[..., rows])
        down = ggml_mxfp4(layer["down_proj_blocks"], layer["down_proj_scales"])
        writer.add_tensor(f"{blk}ffn_down_exps.weight", down, raw_dtype=Q.MXFP4)
        writer.add_tensor(f"{blk}ffn_down_exps.bias", layer["down_proj_bias"])
        writer.add_tensor(f"{blk}attn_sinks.weight", weights.pop(f"model.layers.{i}.self_attn.sinks"))
    for name, value in weights.items():
        module, _, suffix = name.rpartition(".")
        if module in TOP:
            writer.add_tensor(f"{TOP[module]}.{suffix}", value)
            continue
        layer, local = module.removeprefix("model.layers.").split(".", 1)
        writer.add_tensor(f"blk.{layer}.{LAYER[local]}.{suffix}", value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_llama_cpp_gpt_oss_gguf_equals_transformers(tmp_path: Path):
    write_gguf(tmp_path / "gpt-oss.gguf")
    model = load(str(tmp_path / "gpt-oss.gguf")).model
    folder_model = load(str(FOLDER)).model
    # GGUF has no key for the SwiGLU clamp: llama.cpp hard-codes gpt-oss's 7, the tiny checkpoint has 1 (so
    # that its clamps bite), given here as the checkpoint's config gives it to the folder's model.
    assert model.args.swiglu_limit == 7.0
    for layer in model.layers:
        layer.mlp.experts.activation = clamped_swiglu(model.args.swiglu_alpha, folder_model.args.swiglu_limit)
    for name in ("gate_proj", "up_proj", "down_proj"):  # the experts: the same MLX mxfp4 bits
        ours, theirs = model.layers[2].mlp.experts[name], folder_model.layers[2].mlp.experts[name]
        assert ours.mode == "mxfp4"
        for part in ("weight", "scales", "bias"):
            np.testing.assert_array_equal(np.array(ours[part]), np.array(theirs[part]), err_msg=name + part)
    ref = np.load(FOLDER / "reference.npz")
    tokens, want = ref["tokens_1"], ref["logits_1"]
    table, cache, rows, done = block_table(1, len(tokens)), new_cache(model), [], 0
    for n in (60, 50, 39, 1):
        rows.append(forward(model, cache, [SequenceSlice(table, done, n, True)], tokens[done : done + n]))
        done += n
    assert float(np.abs(np.concatenate(rows) - want).max()) <= TOL


def test_ggml_mxfp4_blocks_decode_as_gguf_quants_does():
    """The reader's re-laid codes and exponents, dequantized by MLX, equal gguf-py's own MXFP4 decoding."""
    from mlx_infer.loading.gguf_mxfp4 import mxfp4_from_gguf

    rng = np.random.default_rng(0)
    values = (rng.standard_normal((3, 5, 64)) * 2.0 ** rng.integers(-6, 6, (3, 5, 1))).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.MXFP4)
    words, scales = mxfp4_from_gguf(raw, values.shape)
    got = mx.dequantize(words, scales, None, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    np.testing.assert_array_equal(np.array(got), gguf.quants.dequantize(raw, Q.MXFP4).reshape(values.shape))


def test_planned_gguf_weights_equal_what_load_holds(tmp_path: Path):
    from mlx.utils import tree_flatten

    from mlx_infer.plan.planner import make_plan

    write_gguf(tmp_path / "gpt-oss.gguf")
    for keep_quantized in (None, False):
        loaded = load(str(tmp_path / "gpt-oss.gguf"), keep_quantized=keep_quantized)
        held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        plan = make_plan(str(tmp_path / "gpt-oss.gguf"), keep_quantized=keep_quantized, backend="cpu")
        assert plan.weights_bytes == held
