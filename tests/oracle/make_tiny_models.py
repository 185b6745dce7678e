"""Write a tiny random checkpoint per architecture, with transformers' logits, into tests/oracle/tiny/.

transformers is the independent oracle: it builds each model from its own config class, its weights are
drawn here, ``save_pretrained`` writes them with the Hugging Face names (so ``sanitize()`` is tested on
the layout real checkpoints have), and its float32 forward over two prompts gives the reference logits.
Nothing of mlx-infer is imported. Adding an architecture is: write ``mlx_infer/models/<arch>.py``, add
its config to ``ARCHS``, run this, and ``tests/test_architectures.py`` compares.

Run it with the oracle venv (see make_references.py), never the project's venv:

    HF_HUB_OFFLINE=1 /tmp/oracle-venv/bin/python tests/oracle/make_tiny_models.py [NAME ...]

Each ``tests/oracle/tiny/<name>/`` holds ``config.json``, ``model.safetensors``, a word-level
``tokenizer.json`` (one id per word ``w<i>``, so the folder loads like any model folder) and
``reference.npz``: ``tokens_<i>`` (int32 ``[n]``) and ``logits_<i>`` (float32 ``[n, vocab]``, every
position of one full forward) for each prompt ``i``, and ``versions`` (transformers, torch).
"""

from __future__ import annotations

import copy
import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig

OUT = Path(__file__).parent / "tiny"
VOCAB = 128
# One prompt shorter than a block-aligned chunk, one long enough to cross every sliding window below
# and several linear-attention chunks (transformers' chunked DeltaNet uses 64-token chunks).
PROMPT_LENGTHS = (23, 150)

_BASE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
    num_hidden_layers=2, max_position_embeddings=512, pad_token_id=0, bos_token_id=1, eos_token_id=2,
    # Not the default base, so a loader that misses transformers 5's rope_parameters fails.
    rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
)


def _yarn(**changes) -> dict:
    """Ministral 3's rope_parameters (YaRN plus ``llama_4_scaling_beta``), scaled down; a fresh dict."""
    params = {
        "rope_type": "yarn", "rope_theta": 3000.0, "factor": 16.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.5,
        "llama_4_scaling_beta": 0.1,
    }
    params.update(changes)
    return {k: v for k, v in params.items() if v is not None}

_PIXTRAL = dict(
    model_type="pixtral", hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    head_dim=16, image_size=28, patch_size=14,
)


def _gemma4_rope() -> dict:
    """A fresh dict each call: transformers mutates rope_parameters in place."""
    return {
        "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0},
        "full_attention": {
            "rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 100000.0,
        },
    }


# name -> transformers config kwargs (``model_type`` picks the config class). Keep them small: the
# folders are committed.
ARCHS: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(_BASE, model_type="qwen2", tie_word_embeddings=True),
    "qwen3": dict(_BASE, model_type="qwen3", head_dim=24, tie_word_embeddings=False),
    "qwen3_moe": dict(
        _BASE, model_type="qwen3_moe", head_dim=16, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=32, decoder_sparse_step=1, norm_topk_prob=True, tie_word_embeddings=False,
    ),
    "gemma3_text": dict(
        _BASE, model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=1, head_dim=16,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
        query_pre_attn_scalar=24, attn_logit_softcapping=None, final_logit_softcapping=None,
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 3000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
        },
    ),
    "phi3": dict(_BASE, model_type="phi3", partial_rotary_factor=0.5, tie_word_embeddings=False),
    # MLA + group-limited sigmoid routing; YaRN whose mscale_all_dim scales the softmax by mscale² (equal
    # to mscale, as in every DeepSeek and Kimi config and as GGUF assumes: it stores only mscale_all_dim).
    # scoring_func/topk_method are not transformers' fields but real configs carry them (llama.cpp's
    # converter writes the gating function from scoring_func); model.f32.gguf: make_tiny_gguf.py.
    "deepseek_v3": dict(
        _BASE, model_type="deepseek_v3", num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
        scoring_func="sigmoid", topk_method="noaux_tc",
        q_lora_rank=48, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2, n_shared_experts=1,
        moe_intermediate_size=32, routed_scaling_factor=2.5, norm_topk_prob=True, rope_interleave=True,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 3000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.5, "mscale_all_dim": 0.5, "beta_fast": 32, "beta_slow": 1,
        },
    ),
    # DeepSeek V2 (-Lite): the same MLA, softmax routing limited to the groups with the best single score;
    # YaRN with mscale == mscale_all_dim as V2-Lite's (0.707).
    "deepseek_v2": dict(
        _BASE, model_type="deepseek_v2", num_hidden_layers=3, num_key_value_heads=4, first_k_dense_replace=1,
        q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        n_routed_experts=8, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        num_experts_per_tok=3, n_shared_experts=2, moe_intermediate_size=16, routed_scaling_factor=1.5,
        tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 3000.0, "factor": 4.0, "original_max_position_embeddings": 128,
            "mscale": 0.707, "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
        },
    ),
    # Kimi K2.5 / K2.6: a vision tower the text model ignores around DeepSeek V3 (saved as transformers
    # lays the composite out: language_model.model.blocks.*).
    "kimi_k25": dict(
        model_type="kimi_k25", auto_class="AutoModelForImageTextToText", tie_word_embeddings=False,
        text_config=dict(
            _BASE, model_type="deepseek_v3", num_key_value_heads=4, first_k_dense_replace=1, q_lora_rank=16,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4,
            n_group=2, topk_group=1, num_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
            routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
        ),
        vision_config=dict(
            patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            pos_emb_height=4, pos_emb_width=4, pos_emb_time=2,
        ),
        projection_hidden_size=32,
    ),
    # GLM-4.7-Flash: DeepSeek V3's attention and router under GLM's names; dense/sparse layers by list.
    "glm4_moe_lite": dict(
        _BASE, model_type="glm4_moe_lite", num_hidden_layers=3, num_key_value_heads=4, q_lora_rank=32,
        kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=24, n_routed_experts=8,
        n_group=1, topk_group=1, num_experts_per_tok=3, n_shared_experts=1, moe_intermediate_size=16,
        routed_scaling_factor=1.8, norm_topk_prob=True, mlp_layer_types=["sparse", "dense", "sparse"],
        tie_word_embeddings=False,
    ),
    # Without the query's low-rank path, one expert group, unnormalised top-k, rope not interleaved.
    "deepseek_v3_no_q_lora": dict(
        _BASE, model_type="deepseek_v3", num_key_value_heads=4, first_k_dense_replace=0, q_lora_rank=None,
        kv_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=12, n_routed_experts=4,
        n_group=1, topk_group=1, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=16,
        routed_scaling_factor=1.5, norm_topk_prob=False, rope_interleave=False, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
    ),
    # YaRN: a 32-token original context stretched 4x, so the 150-token prompt uses both the interpolated
    # and the extrapolated frequencies, and the attention factor (mscale) is not 1.
    "qwen3_yarn": dict(
        _BASE, model_type="qwen3", head_dim=24, tie_word_embeddings=False,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 3000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    # NoPE on layers 1 and 3, which are also the sliding ones.
    "smollm3": dict(
        _BASE, model_type="smollm3", num_hidden_layers=4, no_rope_layers=[1, 0, 1, 0],
        use_sliding_window=True, sliding_window=8, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
    ),
    # Layer 0 dense, layers 1-2 MoE: 8 experts in 4 groups of which 2 are kept, a shared expert,
    # partial rotary, q/k norms, q/k/v biases.
    "glm4_moe": dict(
        _BASE, model_type="glm4_moe", num_hidden_layers=3, head_dim=16, partial_rotary_factor=0.5,
        use_qk_norm=True, attention_bias=True, first_k_dense_replace=1, n_routed_experts=8,
        num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=1, moe_intermediate_size=32,
        routed_scaling_factor=2.5, norm_topk_prob=True, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.5},
    ),
    # YaRN (attention factor from mscale / mscale_all_dim) and Llama-4 query scaling, both over an
    # original context of 32 (64 in mistral3) so that the 150-token prompt crosses several of its steps.
    "ministral3": dict(
        _BASE, model_type="ministral3", head_dim=32, tie_word_embeddings=False, rope_parameters=_yarn(),
    ),
    # The composite (Mistral3ForConditionalGeneration): a tiny vision tower the text model ignores.
    "mistral3": dict(
        model_type="mistral3", auto_class="AutoModelForImageTextToText",
        text_config=dict(
            _BASE, model_type="ministral3", num_hidden_layers=3, head_dim=16, sliding_window=24,
            tie_word_embeddings=False, rope_parameters=_yarn(
                factor=8.0, original_max_position_embeddings=64, mscale=None, mscale_all_dim=None
            ),
        ),
        vision_config=_PIXTRAL,
    ),
    # Mistral Small 3.x: the composite around a plain Mistral text model, its own head.
    "mistral3_small": dict(
        model_type="mistral3", auto_class="AutoModelForImageTextToText", tie_word_embeddings=False,
        text_config=dict(
            _BASE, model_type="mistral", head_dim=16, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 3000.0},
        ),
        vision_config=_PIXTRAL,
    ),
    # Window 8 so the long prompt crosses it; a swiglu_limit of 1 so the experts' clamps bite; YaRN as
    # gpt-oss's own (beta 32/1, truncate false) over a 32-token original context.
    "gpt_oss": dict(
        _BASE, model_type="gpt_oss", num_hidden_layers=4, head_dim=16, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"] * 2, num_local_experts=4, num_experts_per_tok=2,
        intermediate_size=32, swiglu_limit=1.0,
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 3000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 32,
        },
    ),
    # Gemma 4 small ("E2B"-like): per-layer inputs, the last two layers (one of each type) reading the
    # K/V of layers 2 and 3 with double-wide MLPs, wider global heads with proportional (partial) RoPE.
    "gemma4_text": dict(
        _BASE, model_type="gemma4_text", num_hidden_layers=6, head_dim=16, global_head_dim=32,
        sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 3, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True,
        final_logit_softcapping=30.0, rope_parameters=_gemma4_rope(),
    ),
    # Gemma 4 large ("26B-A4B"-like), composite config: keys equal values on global layers (one KV head
    # there), a dense MLP plus routed experts in every layer, no per-layer inputs.
    "gemma4": dict(
        model_type="gemma4", vision_config=None, audio_config=None,
        text_config=dict(
            _BASE, model_type="gemma4_text", num_hidden_layers=4, head_dim=16, global_head_dim=32,
            sliding_window=8, layer_types=["sliding_attention", "full_attention"] * 2,
            attention_k_eq_v=True, num_global_key_value_heads=1, hidden_size_per_layer_input=0,
            enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32,
            final_logit_softcapping=30.0, rope_parameters=_gemma4_rope(),
        ),
    ),
}


def _hybrid(model_type: str, **extra) -> dict:
    """Qwen3-Next / Qwen3.5 text configs: Gated DeltaNet layers between gated full-attention layers,
    grouped value heads (4 value heads over 2 key heads) and partial RoPE."""
    return dict(
        copy.deepcopy(_BASE), model_type=model_type, num_hidden_layers=4, head_dim=16,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 3000.0, "partial_rotary_factor": 0.5},
        **extra,
    )


_HYBRID_MOE = dict(
    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
)
# The vision tower of a composite checkpoint: as small as its config allows (the text forward never runs it,
# but its tensors are in the file, as in real checkpoints, for sanitize() to drop).
_TINY_VISION = dict(
    depth=1, hidden_size=16, intermediate_size=16, num_heads=2, patch_size=2, out_hidden_size=64,
    num_position_embeddings=16,
)

ARCHS.update({
    "qwen3_next": _hybrid(
        "qwen3_next", **_HYBRID_MOE, decoder_sparse_step=1, mlp_only_layers=[2], norm_topk_prob=True
    ),
    # As Qwen3-Next-80B is published (every layer sparse): the layout llama.cpp's GGUF can hold.
    "qwen3_next_all_moe": _hybrid("qwen3_next", **_HYBRID_MOE, decoder_sparse_step=1, mlp_only_layers=[]),
    "qwen3_5_text": _hybrid("qwen3_5_text"),
    "qwen3_5_moe_text": _hybrid("qwen3_5_moe_text", **_HYBRID_MOE),
    # Composite (image-text) checkpoints: the text model under model.language_model, a vision tower beside it.
    "qwen3_5": dict(
        model_type="qwen3_5", auto_class="AutoModelForImageTextToText", text_config=_hybrid("qwen3_5_text"),
        vision_config=_TINY_VISION, tie_word_embeddings=False,
    ),
    "qwen3_5_moe": dict(
        model_type="qwen3_5_moe", auto_class="AutoModelForImageTextToText",
        text_config=_hybrid("qwen3_5_moe_text", **_HYBRID_MOE), vision_config=_TINY_VISION,
        tie_word_embeddings=False,
    ),
})

# name -> the ARCHS entry whose checkpoint is written with its MoE experts in MXFP4, as gpt-oss's official
# checkpoints are; the logits are those of transformers' own dequantizing loader on that folder.
MXFP4: dict[str, str] = {"gpt_oss_mxfp4": "gpt_oss"}
FP4_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over several units (transformers' 0.02 init makes them
    all nearly equal, and a comparison of nearly equal numbers proves little).

    Matrices (and embeddings, convolutions): normal with std 1/sqrt(last dim). Vectors (norm weights,
    biases, per-head decay parameters, saved buffers such as a router's score correction): their own
    init plus normal noise of 0.1, which keeps a norm near 1 (or a Gemma-style ``1 + w`` norm near 1)
    and a log-decay near its intended range.
    """
    gen = torch.Generator().manual_seed(seed)
    # Saved buffers too (a router's score correction bias), which would otherwise stay zero.
    saved = model.state_dict()
    buffers = [(n, b) for n, b in model.named_buffers() if n in saved and b.is_floating_point()]
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()) + sorted(buffers):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            else:
                p.add_(0.1 * noise)


def write_word_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))


def mxfp4(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """OCP MXFP4 of ``w`` [..., in] (NumPy reference): per 32 values an E8M0 exponent
    ``floor(log2(max|x|)) - 2`` (FP4's largest exponent) and each value rounded to the nearest FP4
    (E2M1) value, clamped at 6. Returns (blocks uint8 [..., in / 32, 16] with the low nibble first,
    scales uint8 [..., in / 32]) as gpt-oss checkpoints store them."""
    groups = w.reshape(*w.shape[:-1], -1, 32).astype(np.float64)
    amax = np.abs(groups).max(axis=-1, keepdims=True)
    exponent = np.floor(np.log2(np.where(amax > 0, amax, 1.0))) - 2
    scaled = np.clip(groups / 2.0**exponent, -6.0, 6.0)
    codes = np.abs(np.abs(scaled)[..., None] - FP4_VALUES).argmin(axis=-1) + 8 * (scaled < 0)
    pairs = codes.reshape(*codes.shape[:-1], 16, 2).astype(np.uint8)
    blocks = pairs[..., 0] | (pairs[..., 1] << 4)
    return np.ascontiguousarray(blocks), np.ascontiguousarray((exponent[..., 0] + 127).astype(np.uint8))


def save_mxfp4(model: torch.nn.Module, folder: Path) -> None:
    """Rewrite ``folder``'s checkpoint with every ``experts.{gate_up,down}_proj`` ([E, in, out]) as MXFP4
    ``_blocks``/``_scales`` of its ``[E, out, in]`` transpose, and the config's quantization_config."""
    from safetensors.torch import save_file

    tensors = {}
    for key, value in model.state_dict().items():
        if key.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4(value.transpose(1, 2).numpy())
            tensors[f"{key}_blocks"] = torch.from_numpy(blocks)
            tensors[f"{key}_scales"] = torch.from_numpy(scales)
        else:
            tensors[key] = value.contiguous()
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": None}
    (folder / "config.json").write_text(json.dumps(config, indent=2))


def make(name: str, kwargs: dict, mxfp4_experts: bool = False) -> None:
    kwargs = copy.deepcopy(kwargs)
    auto_class = getattr(transformers, kwargs.pop("auto_class", "AutoModelForCausalLM"))
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    # The eager (per-expert loop) experts: the reference implementation, and the one that runs in float64.
    model = auto_class.from_config(config, dtype=torch.float32, experts_implementation="eager").eval()
    init_weights(model, seed=sum(map(ord, name)))
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder)
    if mxfp4_experts:
        from transformers import Mxfp4Config

        save_mxfp4(model, folder)
        model = auto_class.from_pretrained(
            folder, dtype=torch.float32, quantization_config=Mxfp4Config(dequantize=True),
            attn_implementation="eager", experts_implementation="eager",
        ).eval()

    rng = np.random.default_rng(7)
    arrays: dict[str, np.ndarray] = {}
    for i, n in enumerate(PROMPT_LENGTHS):
        tokens = rng.integers(3, VOCAB, n).astype(np.int32)
        with torch.no_grad():
            logits = model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()
        arrays[f"tokens_{i}"], arrays[f"logits_{i}"] = tokens, logits
    # transformers' own float32 rounding error (against the same model in float64): where it is
    # larger than the default tolerance (long recurrences), test_architectures scales its tolerance by it.
    model.double()
    noise = 0.0
    for i in range(len(PROMPT_LENGTHS)):
        with torch.no_grad():
            exact = model(torch.tensor(arrays[f"tokens_{i}"][None], dtype=torch.long)).logits[0].numpy()
        noise = max(noise, float(np.abs(arrays[f"logits_{i}"] - exact).max()))
    arrays["float32_noise"] = np.array(noise, dtype=np.float64)
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    arrays["versions"] = np.array(json.dumps(versions))
    np.savez_compressed(folder / "reference.npz", **arrays)
    spread = float(np.std(arrays["logits_1"]))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, logit std {spread:.2f}, "
          f"float32 noise {noise:.1e}")


def main(names: list[str]) -> None:
    for name in names or sorted([*ARCHS, *MXFP4]):
        if name in MXFP4:
            make(name, ARCHS[MXFP4[name]], mxfp4_experts=True)
        else:
            make(name, ARCHS[name])


if __name__ == "__main__":
    main(sys.argv[1:])
