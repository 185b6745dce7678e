"""Checkpoint layouts other than what ``save_pretrained`` wrote into tests/oracle/tiny, loading to the same
model: Hub extras that must be dropped (GLM's multi-token-prediction layer) and transformers 5's fused
in-memory expert tensors; and the memory plan of the new architectures' folders.

The oracle is the tiny checkpoint itself: the rearranged weights must give its logits exactly.
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV, new_cache
from mlx_infer.loading import load, open_checkpoint
from mlx_infer.loading.build import build_model
from mlx_infer.plan import make_plan

TINY = Path(__file__).parent / "oracle" / "tiny"


def logits(model) -> np.ndarray:
    tokens = np.load(TINY / "glm4_moe" / "reference.npz")["tokens_0"]
    cache = [LayerKV(8, 4, *model.kv_shape(), mx.float32) for _ in model.layers]
    meta = build_metadata([SequenceSlice(list(range(8)), 0, len(tokens), True)], 4)
    return np.array(model(mx.array(tokens), cache, meta))


def glm4_moe(rearrange) -> np.ndarray:
    ckpt = open_checkpoint(str(TINY / "glm4_moe"))
    return logits(build_model(ckpt.config, rearrange(dict(ckpt.weights)), "glm4_moe"))


def test_glm4_moe_multi_token_prediction_layer_is_dropped():
    def with_mtp_layer(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # GLM-4.5 on the Hub: layer num_hidden_layers is the MTP layer (a decoder layer plus its own
        # projections and norms), which transformers ignores at load.
        extra = {k.replace("layers.2.", "layers.3."): v for k, v in weights.items() if ".layers.2." in k}
        extra["model.layers.3.eh_proj.weight"] = mx.zeros((64, 128))
        extra["model.layers.3.enorm.weight"] = mx.ones((64,))
        return {**weights, **extra}

    np.testing.assert_array_equal(glm4_moe(with_mtp_layer), glm4_moe(dict))


def test_glm4_moe_fused_expert_tensors_load_like_per_expert_ones():
    def fused(weights: dict[str, mx.array]) -> dict[str, mx.array]:
        for i in (1, 2):
            p = f"model.layers.{i}.mlp.experts"
            per = {n: mx.stack([weights.pop(f"{p}.{e}.{n}_proj.weight") for e in range(8)])
                   for n in ("gate", "up", "down")}
            weights[f"{p}.gate_up_proj"] = mx.concatenate([per["gate"], per["up"]], axis=1)
            weights[f"{p}.down_proj"] = per["down"]
        return weights

    np.testing.assert_array_equal(glm4_moe(fused), glm4_moe(dict))


def test_mistral3_head_stored_beside_a_tied_flag_is_used():
    """transformers 5 keeps a stored lm_head that differs from the embeddings even when the composite's
    tie flag (True by default) says tied."""
    ckpt = open_checkpoint(str(TINY / "mistral3"))
    assert ckpt.config["tie_word_embeddings"] is True
    head = mx.random.normal((128, 64), key=mx.random.key(3))
    stored = build_model(ckpt.config, {**ckpt.weights, "language_model.lm_head.weight": head}, "mistral3")
    untied = {**ckpt.config, "tie_word_embeddings": False}
    expected = build_model(untied, {**ckpt.weights, "language_model.lm_head.weight": head}, "mistral3")
    np.testing.assert_array_equal(logits(stored), logits(expected))
    assert not np.allclose(logits(stored), logits(build_model(ckpt.config, dict(ckpt.weights), "mistral3")))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])
def test_gated_deltanet_weights_in_mlx_lm_layout_load_the_same(name: str):
    """mlx-community Qwen3-Next / Qwen3.5 folders hold the weights as mlx-lm's sanitize leaves them: the
    convolution as nn.Conv1d's [C, K, 1] and the zero-centred norms with their one added (mlx-lm's
    qwen3_next.py / qwen3_5.py ``sanitize``). They must give the Hugging Face layout's logits."""
    norms = (".input_layernorm.weight", ".post_attention_layernorm.weight", "model.norm.weight",
             ".q_norm.weight", ".k_norm.weight")

    def mlx_lm_layout(name: str, w: mx.array) -> mx.array:
        if "conv1d.weight" in name:
            return w.moveaxis(2, 1)
        return w + 1.0 if name.endswith(norms) else w

    ckpt = open_checkpoint(str(TINY / name))
    assert any(k.endswith("model.norm.weight") for k in ckpt.weights)  # the composite's names end alike
    hf = build_model(ckpt.config, dict(ckpt.weights), name)
    moved = build_model(ckpt.config, {k: mlx_lm_layout(k, w) for k, w in ckpt.weights.items()}, name)
    np.testing.assert_allclose(recurrent_logits(moved), recurrent_logits(hf), rtol=0, atol=1e-5)


def recurrent_logits(model) -> np.ndarray:
    tokens = np.load(TINY / "qwen3_next" / "reference.npz")["tokens_0"]
    cache = new_cache(model, 8, 4, mx.float32)
    meta = build_metadata([SequenceSlice(list(range(8)), 0, len(tokens), True)], 4)
    return np.array(model(mx.array(tokens), cache, meta))


@pytest.mark.parametrize("name", ["glm4_moe", "mistral3", "smollm3"])
def test_memory_plan_counts_what_load_holds(name: str):
    """The planner builds the architecture from config.json alone: the composite's text model only, the
    MoE's stacked experts."""
    loaded = load(str(TINY / name))
    held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
    assert make_plan(str(TINY / name)).weights_bytes == held
