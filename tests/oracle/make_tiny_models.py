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

import json
import math
import sys
from pathlib import Path

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM

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
}


def init_weights(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that logits spread over several units (transformers' 0.02 init makes them
    all nearly equal, and a comparison of nearly equal numbers proves little).

    Matrices (and embeddings, convolutions): normal with std 1/sqrt(last dim). Vectors (norm weights,
    biases, per-head decay parameters, a router's correction bias): their own init plus normal noise of
    0.1, which keeps a norm near 1 (or a Gemma-style ``1 + w`` norm near 1) and a log-decay near its
    intended range.
    """
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if p.dim() >= 2:
                p.copy_(noise / math.sqrt(p.shape[-1]))
            else:
                p.add_(0.1 * noise)
        # A saved buffer that is a weight in all but name: the MoE router's selection-only bias (DeepSeek V3).
        for name, b in sorted(model.named_buffers()):
            if name.endswith("e_score_correction_bias"):
                b.add_(0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float32))


def write_word_tokenizer(folder: Path) -> None:
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))


def make(name: str, kwargs: dict) -> None:
    kwargs = dict(kwargs)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    init_weights(model, seed=sum(map(ord, name)))
    folder = OUT / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    write_word_tokenizer(folder)

    rng = np.random.default_rng(7)
    arrays: dict[str, np.ndarray] = {}
    for i, n in enumerate(PROMPT_LENGTHS):
        tokens = rng.integers(3, VOCAB, n).astype(np.int32)
        with torch.no_grad():
            logits = model(torch.tensor(tokens[None], dtype=torch.long)).logits[0].float().numpy()
        arrays[f"tokens_{i}"], arrays[f"logits_{i}"] = tokens, logits
    versions = {"transformers": transformers.__version__, "torch": torch.__version__}
    arrays["versions"] = np.array(json.dumps(versions))
    np.savez_compressed(folder / "reference.npz", **arrays)
    spread = float(np.std(arrays["logits_1"]))
    print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, logit std {spread:.2f}")


def main(names: list[str]) -> None:
    for name in names or sorted(ARCHS):
        make(name, ARCHS[name])


if __name__ == "__main__":
    main(sys.argv[1:])
