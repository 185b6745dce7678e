"""GGUF files of the newer architectures, written here as llama.cpp's convert_hf_to_gguf.py writes them
from the tiny checkpoints in tests/oracle/tiny (float32 tensors, its names and metadata keys, its Q/K row
permutation where it applies one, GLM's multi-token-prediction layer counted in block_count).

The oracle is the same checkpoint loaded from its folder (itself equal to transformers, see
test_architectures.py): the GGUF must give the same logits.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache
from mlx_infer.loading import load, open_checkpoint
from mlx_infer.loading.build import build_model
from mlx_infer.plan import make_plan

TINY = Path(__file__).parent / "oracle" / "tiny"
WORDS = [f"w{i}" for i in range(128)]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied to Q and K rows."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(
    arch: gguf.MODEL_ARCH, config: dict, weights: dict[str, np.ndarray], blocks: int, permute: bool
) -> dict[str, np.ndarray]:
    """HF-named float32 weights -> GGUF names, experts stacked [E, out, in] as the converter stacks them."""
    tensor_map = gguf.get_tensor_name_map(arch, blocks)
    experts: dict[str, dict[int, np.ndarray]] = {}
    out = {}
    for name, w in weights.items():
        base, _, suffix = name.rpartition(".")
        if ".mlp.experts." in name:  # model.layers.1.mlp.experts.5.up_proj.weight
            layer, _, rest = base.partition(".mlp.experts.")
            e, _, proj = rest.partition(".")
            experts.setdefault(f"{layer}.mlp.experts.{proj}", {})[int(e)] = w
            continue
        if name.endswith("e_score_correction_bias"):
            base, suffix = name.removesuffix("_bias"), "bias"
        if permute and base.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"]
            w = llama_cpp_permute(w, heads)
        out[f"{tensor_map.get_name(base)}.{suffix}"] = w
    for base, per_expert in experts.items():
        out[f"{tensor_map.get_name(base)}.weight"] = np.stack([per_expert[e] for e in sorted(per_expert)])
    return out


def write_gguf(path: Path, arch: gguf.MODEL_ARCH, config: dict, tensors: dict[str, np.ndarray], blocks: int,
               extra) -> None:
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(blocks)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_parameters"]["rope_theta"])
    extra(writer, config)
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(WORDS)
    writer.add_token_types([1] * len(WORDS))
    writer.add_token_merges([])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for name, w in tensors.items():
        writer.add_tensor(name, np.ascontiguousarray(w, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def glm4moe_metadata(writer: gguf.GGUFWriter, c: dict) -> None:
    writer.add_rope_dimension_count(int(c["head_dim"] * c["rope_parameters"]["partial_rotary_factor"]))
    writer.add_expert_count(c["n_routed_experts"])
    writer.add_expert_used_count(c["num_experts_per_tok"])
    writer.add_expert_feed_forward_length(c["moe_intermediate_size"])
    writer.add_expert_shared_count(c["n_shared_experts"])
    writer.add_leading_dense_block_count(c["first_k_dense_replace"])
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    writer.add_expert_weights_scale(c["routed_scaling_factor"])
    writer.add_expert_weights_norm(c["norm_topk_prob"])
    writer.add_expert_group_count(c["n_group"])
    writer.add_expert_group_used_count(c["topk_group"])
    writer.add_nextn_predict_layers(1)


def mistral3_metadata(writer: gguf.GGUFWriter, c: dict) -> None:
    rope = c["rope_parameters"]
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(rope["factor"])
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_rope_scaling_yarn_beta_fast(rope["beta_fast"])
    writer.add_rope_scaling_yarn_beta_slow(rope["beta_slow"])
    writer.add_rope_scaling_yarn_log_mul(rope["mscale_all_dim"])
    writer.add_attn_temperature_scale(rope["llama_4_scaling_beta"])


def with_mtp_layer(weights: dict[str, np.ndarray], last: int) -> dict[str, np.ndarray]:
    """GLM-4.5's multi-token-prediction layer after the last one: a decoder layer and its own parts."""
    mtp = {k.replace(f"layers.{last}.", f"layers.{last + 1}."): v for k, v in weights.items()
           if f".layers.{last}." in k}
    hidden = weights["model.norm.weight"].shape[0]
    mtp[f"model.layers.{last + 1}.eh_proj.weight"] = np.zeros((hidden, 2 * hidden), np.float32)
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.{last + 1}.{norm}.weight"] = np.ones(hidden, np.float32)
    return {**weights, **mtp}


# name -> (llama.cpp arch, Q/K permuted, metadata writer, config changes the GGUF cannot express)
CASES = {
    # llama.cpp hard-codes SmolLM3's NoPE interval (4) and has no sliding window for it.
    "smollm3": (gguf.MODEL_ARCH.SMOLLM3, True, lambda w, c: None,
                {"no_rope_layers": None, "layer_types": None, "use_sliding_window": False}),
    "glm4_moe": (gguf.MODEL_ARCH.GLM4_MOE, False, glm4moe_metadata, {}),
    "ministral3": (gguf.MODEL_ARCH.MISTRAL3, True, mistral3_metadata, {}),
}


def logits(model) -> np.ndarray:
    tokens = np.load(TINY / "glm4_moe" / "reference.npz")["tokens_1"]
    cache = new_cache(model, 40, 4, mx.float32)
    meta = build_metadata([SequenceSlice(list(range(40)), 0, len(tokens), True)], 4)
    return np.array(model(mx.array(tokens), cache, meta))


@pytest.mark.parametrize("name", sorted(CASES))
def test_gguf_of_tiny_checkpoint_gives_its_logits(name: str, tmp_path: Path):
    arch, permute, metadata, changes = CASES[name]
    ckpt = open_checkpoint(str(TINY / name))
    config = {**ckpt.config, **changes}
    weights = {k: np.array(v) for k, v in ckpt.weights.items()}
    layers = config["num_hidden_layers"]
    blocks = layers
    if arch == gguf.MODEL_ARCH.GLM4_MOE:
        weights, blocks = with_mtp_layer(weights, layers - 1), layers + 1
    tensors = gguf_tensors(arch, config, weights, blocks, permute)
    write_gguf(tmp_path / "m.gguf", arch, config, tensors, blocks, metadata)

    loaded = load(str(tmp_path / "m.gguf"))
    assert loaded.config["model_type"] == config["model_type"]
    assert loaded.config["num_hidden_layers"] == layers
    # The memory plan counts what the loader keeps (not GLM's multi-token-prediction layer).
    held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert make_plan(str(tmp_path / "m.gguf")).weights_bytes == held
    expected = build_model(config, dict(ckpt.weights), name)
    np.testing.assert_allclose(logits(loaded.model), logits(expected), atol=1e-5, rtol=0)
