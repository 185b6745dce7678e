"""GGUF files -> HF-style config, HF-named weights and the metadata the tokenizer is built from.

Q4_0 / Q4_1 / Q8_0 (and F32/F16) files go through ``mx.load``, which returns the quantized tensors as
MLX affine arrays (``weight`` uint32, ``scales``, ``biases``) losslessly. Any other type (K-quants,
BF16, ...) makes ``mx.load`` fail or round, so such files are read tensor by tensor and dequantized
exactly to float32 with the ``gguf`` package; the policy may re-quantize them (see ``policy.py``).
When the K-quant kernels will run them (``kquant_blocks``), Q4_K/Q5_K/Q6_K matrices are instead kept
as their raw blocks (uint8 ``[rows, bytes per row]``) for layers that compute on them directly. MXFP4
tensors (gpt-oss's experts) become MLX ``mxfp4`` weights and scales (``gguf_mxfp4.py``), as exact.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf.constants import MODEL_ARCH_NAMES, MODEL_TENSOR, MODEL_TENSORS, TENSOR_NAMES, GGMLQuantizationType
from gguf.quants import dequantize

from mlx_infer.errors import InvalidCheckpoint, UnsupportedArchitecture
from mlx_infer.loading import gguf_hybrid
from mlx_infer.loading.gguf_config import hf_config, llama3_scaling
from mlx_infer.loading.gguf_file import GGUFHeader, read_header, tensor_bytes
from mlx_infer.loading.gguf_gemma4 import NAMES as GEMMA4_NAMES
from mlx_infer.loading.gguf_gemma4 import fold_rope_freqs, hf_key, stacked_experts
from mlx_infer.loading.gguf_mxfp4 import mxfp4_from_gguf
from mlx_infer.loading.hf import one_line

Q = GGMLQuantizationType
# Types mx.load reads exactly (BF16 it narrows to float16, K-quants it cannot read).
MX_LOAD_EXACT = {Q.F32, Q.F16, Q.Q4_0, Q.Q4_1, Q.Q8_0}
FLOAT_TYPES = {Q.F32, Q.F16, Q.BF16, Q.F64}
# Re-quantization bits for a dequantized type: 8 for the 5..8-bit types, 4 for the rest.
EIGHT_BIT_SOURCES = {Q.Q8_0, Q.Q8_1, Q.Q8_K, Q.Q6_K, Q.Q5_K, Q.Q5_0, Q.Q5_1}
# Types the K-quant matvec kernels compute on as stored (metal_kernels.gguf_reference.BLOCK_BYTES).
BLOCK_KINDS = {Q.Q4_K: "Q4_K", Q.Q5_K: "Q5_K", Q.Q6_K: "Q6_K"}

L = "model.layers.{bid}."
# GGUF tensor kind -> Hugging Face module path (the gguf side of each name is TENSOR_NAMES[kind]).
HF_NAMES: dict[MODEL_TENSOR, str] = {
    MODEL_TENSOR.TOKEN_EMBD: "model.embed_tokens",
    MODEL_TENSOR.OUTPUT_NORM: "model.norm",
    MODEL_TENSOR.OUTPUT: "lm_head",
    MODEL_TENSOR.ATTN_NORM: L + "input_layernorm",
    MODEL_TENSOR.ATTN_Q: L + "self_attn.q_proj",
    MODEL_TENSOR.ATTN_K: L + "self_attn.k_proj",
    MODEL_TENSOR.ATTN_V: L + "self_attn.v_proj",
    MODEL_TENSOR.ATTN_QKV: L + "self_attn.qkv_proj",
    MODEL_TENSOR.ATTN_OUT: L + "self_attn.o_proj",
    MODEL_TENSOR.ATTN_Q_NORM: L + "self_attn.q_norm",
    MODEL_TENSOR.ATTN_K_NORM: L + "self_attn.k_norm",
    MODEL_TENSOR.ATTN_POST_NORM: L + "post_attention_layernorm",
    MODEL_TENSOR.FFN_NORM: L + "post_attention_layernorm",
    MODEL_TENSOR.FFN_PRE_NORM: L + "pre_feedforward_layernorm",
    MODEL_TENSOR.FFN_POST_NORM: L + "post_feedforward_layernorm",
    MODEL_TENSOR.FFN_GATE: L + "mlp.gate_proj",
    MODEL_TENSOR.FFN_UP: L + "mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN: L + "mlp.down_proj",
    MODEL_TENSOR.FFN_GATE_INP: L + "mlp.gate",
    # Experts come stacked [n_expert, out, in]: the name the MoE model uses after its own stacking.
    MODEL_TENSOR.FFN_GATE_EXP: L + "mlp.switch_mlp.gate_proj",
    MODEL_TENSOR.FFN_UP_EXP: L + "mlp.switch_mlp.up_proj",
    MODEL_TENSOR.FFN_DOWN_EXP: L + "mlp.switch_mlp.down_proj",
    MODEL_TENSOR.FFN_GATE_SHEXP: L + "mlp.shared_experts.gate_proj",
    MODEL_TENSOR.FFN_UP_SHEXP: L + "mlp.shared_experts.up_proj",
    MODEL_TENSOR.FFN_DOWN_SHEXP: L + "mlp.shared_experts.down_proj",
    # The router's score correction, stored as exp_probs_b.bias: HF's e_score_correction_bias.
    MODEL_TENSOR.FFN_EXP_PROBS_B: L + "mlp.gate.e_score_correction",
}
# Architectures whose Q/K rows llama.cpp's converter permutes (its LlamaModel and subclasses).
PERMUTED_QK = ("llama", "smollm3", "mistral3")
ARCH_OVERRIDES: dict[str, dict[MODEL_TENSOR, str]] = {
    "phi3": {MODEL_TENSOR.FFN_UP: L + "mlp.gate_up_proj"},  # Phi-3 keeps gate and up fused
    # DeepSeek V2/V3, Kimi K2 (MLA). llama.cpp's converter splits kv_b_proj into k_b_proj (transposed) and
    # v_b_proj: deepseek_v3's sanitize maps those, and the router bias's name.
    "deepseek2": {
        MODEL_TENSOR.ATTN_Q_A: L + "self_attn.q_a_proj",
        MODEL_TENSOR.ATTN_Q_A_NORM: L + "self_attn.q_a_layernorm",
        MODEL_TENSOR.ATTN_Q_B: L + "self_attn.q_b_proj",
        MODEL_TENSOR.ATTN_KV_A_MQA: L + "self_attn.kv_a_proj_with_mqa",
        MODEL_TENSOR.ATTN_KV_A_NORM: L + "self_attn.kv_a_layernorm",
        MODEL_TENSOR.ATTN_KV_B: L + "self_attn.kv_b_proj",
        MODEL_TENSOR.ATTN_K_B: L + "self_attn.k_b_proj",
        MODEL_TENSOR.ATTN_V_B: L + "self_attn.v_b_proj",
    },
    "gpt-oss": {  # mlx_infer/models/gpt_oss.py's names; sinks arrive as ``sinks.weight`` (its sanitize)
        MODEL_TENSOR.ATTN_SINKS: L + "self_attn.sinks",
        MODEL_TENSOR.FFN_GATE_INP: L + "mlp.router",
        MODEL_TENSOR.FFN_GATE_EXP: L + "mlp.experts.gate_proj",
        MODEL_TENSOR.FFN_UP_EXP: L + "mlp.experts.up_proj",
        MODEL_TENSOR.FFN_DOWN_EXP: L + "mlp.experts.down_proj",
    },
    "gemma4": GEMMA4_NAMES,
    # Qwen3-Next, Qwen3.5 (Gated DeltaNet hybrids): loading/gguf_hybrid.py
    **dict.fromkeys(gguf_hybrid.ARCHS, gguf_hybrid.TENSOR_NAMES),
}
# Tensors that are not weights of a module but RoPE parameters, folded into the config.
ROPE_TENSORS = ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")


@dataclass
class GGUFCheckpoint:
    config: dict[str, Any]
    weights: dict[str, mx.array]  # Hugging Face names
    metadata: dict[str, Any]  # plain Python values, for the tokenizer
    requantize: dict[str, int] = field(default_factory=dict)  # module path -> bits (see policy.py)
    kquants: dict[str, str] = field(default_factory=dict)  # module path -> kind of its raw-block weight


def read_gguf(path: Path, kquant_blocks: bool = False) -> GGUFCheckpoint:
    """Config, Hugging Face-named weights and metadata of a GGUF file.

    ``kquant_blocks``: keep Q4_K/Q5_K/Q6_K matrices as raw blocks (listed in ``kquants``) instead of
    dequantizing them.
    """
    header = read_header(path)
    source = path.name
    config = hf_config(header.metadata, header.tensors, source)
    arch = header.metadata["general.architecture"]
    if all(t.qtype in MX_LOAD_EXACT for t in header.tensors.values()):
        raw, dequantized_from, blocks = _mx_load(path), {}, {}
    else:
        # Matrices whose columns a layout fix moves in units smaller than a K-quant block are decoded.
        decoded = gguf_hybrid.column_permuted(arch, config) if kquant_blocks else set()
        raw, dequantized_from, blocks = _read_tensors(path, header, kquant_blocks, decoded)
    _fold_rope_tensors(raw, config, arch, source)
    names = gguf_to_hf_names(arch, config["num_hidden_layers"])
    weights, requantize, kquants = {}, {}, {}
    for name, value in raw.items():
        # Most names end in .weight/.bias (or MLX's .scales/.biases); a few are bare (Qwen3-Next's ssm_a).
        base, suffix = (name, "") if name in names else name.rpartition(".")[::2]
        if block_index(name) >= config["num_hidden_layers"]:
            continue  # a multi-token-prediction layer (GLM-4.5, Qwen3.5), which generation does not use
        if base not in names:
            raise UnsupportedArchitecture(f"{source}: tensor {name!r} of a {arch} GGUF is not supported")
        hf = names[base]
        if arch == "gemma4":
            key = hf_key(hf, suffix)  # its scales that are parameters rather than a module's weight
        else:
            key = f"{hf}_{suffix}" if hf.endswith("e_score_correction") else gguf_hybrid.param_key(hf, suffix)
        # Block rows are whole output features, so the Q/K row permutation moves them like float rows.
        weights[key] = _fix_layout(hf, suffix, value, config, arch)
        qtype = dequantized_from.get(name)
        if name in blocks:
            kquants[hf] = blocks[name]
        elif qtype is not None and qtype not in FLOAT_TYPES and value.ndim >= 2:
            requantize[hf] = 8 if qtype in EIGHT_BIT_SOURCES else 4
    if arch == "gemma4":
        stacked_experts(weights, requantize)
    if arch in gguf_hybrid.ARCHS:
        gguf_hybrid.restore_hf_layout(weights, config, arch, kquants)
    return GGUFCheckpoint(config, weights, header.metadata, requantize, kquants)


def gguf_to_hf_names(arch: str, n_layers: int) -> dict[str, str]:
    """GGUF tensor base names (``blk.3.attn_q``) of ``arch`` -> Hugging Face module paths."""
    arch_enum = next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch)
    hf_names = {**HF_NAMES, **ARCH_OVERRIDES.get(arch, {})}
    names = {}
    for kind in MODEL_TENSORS[arch_enum]:
        if kind not in hf_names:
            continue
        gguf_name, hf = TENSOR_NAMES[kind], hf_names[kind]
        for bid in range(n_layers) if "{bid}" in gguf_name else [0]:
            names[gguf_name.format(bid=bid)] = hf.format(bid=bid)
    return names


def unpermute_rows(w: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> Hugging Face's rotate-half halves).

    The converter maps rows with ``reshape(n_heads, 2, d/2, ...).swapaxes(1, 2)``; the inverse swaps back.
    It acts on rows (output features) only, so packed quantized rows, scales and biases move alike.
    """
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def block_index(name: str) -> int:
    """The layer a GGUF tensor belongs to (``blk.3.attn_q.weight`` -> 3); -1 outside the blocks."""
    parts = name.split(".")
    return int(parts[1]) if parts[0] == "blk" else -1


def _fix_layout(hf: str, suffix: str, value: mx.array, config: dict[str, Any], arch: str) -> mx.array:
    if arch in PERMUTED_QK and hf.endswith("self_attn.q_proj"):
        return unpermute_rows(value, config["num_attention_heads"])
    if arch in PERMUTED_QK and hf.endswith("self_attn.k_proj"):
        return unpermute_rows(value, config["num_key_value_heads"])
    if arch == "gemma3" and hf.endswith("norm") and suffix == "weight":
        return value - 1.0  # llama.cpp stores Gemma's (1 + w) norm weights with the 1 added
    return value


def _mx_load(path: Path) -> dict[str, mx.array]:
    try:
        return mx.load(str(path))
    except (RuntimeError, ValueError, OSError) as e:
        raise InvalidCheckpoint(f"{path.name}: {one_line(e)}") from None


def _read_tensors(
    path: Path, header: GGUFHeader, kquant_blocks: bool, decoded: set[str]
) -> tuple[dict[str, mx.array], dict[str, Q], dict[str, str]]:
    """Every tensor, dequantized to float32 (with its source type), or kept as raw blocks (with its kind).

    Only matrices stay blocks: the kernels take 2-D rows, so stacked MoE experts are dequantized.
    """
    weights, kinds, blocks = {}, {}, {}
    for name, info in header.tensors.items():
        if info.qtype == Q.MXFP4:  # gpt-oss's experts: MLX's own mxfp4, never dequantized
            scales_name = name.removesuffix(".weight") + ".scales"
            weights[name], weights[scales_name] = mxfp4_from_gguf(tensor_bytes(path, info), info.shape)
            continue
        if kquant_blocks and info.qtype in BLOCK_KINDS and len(info.shape) == 2 and name not in decoded:
            weights[name] = mx.array(np.array(tensor_bytes(path, info)))
            blocks[name] = BLOCK_KINDS[info.qtype]
            continue
        try:
            values = dequantize(tensor_bytes(path, info), info.qtype)
        except (NotImplementedError, ValueError) as e:
            raise InvalidCheckpoint(
                f"{path.name}: tensor {name} ({info.qtype.name}): {one_line(e)}"
            ) from None
        weights[name] = mx.array(np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape))
        kinds[name] = info.qtype
    return weights, kinds, blocks


def _fold_rope_tensors(raw: dict[str, mx.array], config: dict[str, Any], arch: str, source: str) -> None:
    """Turn RoPE factor tensors into the ``rope_scaling`` config the models read."""
    factors = {n: np.array(raw.pop(n).astype(mx.float32)) for n in ROPE_TENSORS if n in raw}
    if arch == "gemma4" and "rope_freqs.weight" in factors:  # proportional RoPE of its global layers
        fold_rope_freqs(factors["rope_freqs.weight"], config, source)
    elif "rope_freqs.weight" in factors:
        head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
        scaling = llama3_scaling(factors["rope_freqs.weight"], config.get("rope_theta", 10000.0), head_dim)
        if scaling is None:
            raise UnsupportedArchitecture(f"{source}: rope_freqs factors do not follow Llama 3's scheme")
        config["rope_scaling"] = scaling
    if "rope_factors_long.weight" in factors:
        long = factors["rope_factors_long.weight"]
        config["rope_scaling"] = {
            **(config.get("rope_scaling") or {}),
            "type": "longrope",
            "rope_type": "longrope",
            "long_factor": long.tolist(),
            "short_factor": factors.get("rope_factors_short.weight", long).tolist(),
        }
