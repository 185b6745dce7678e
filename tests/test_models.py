"""Every architecture against an independent float64 NumPy forward pass over Hugging Face-named weights.

Tiny random models (hidden 64, vocab 128) run through the paged, incremental path the engine uses
(permuted non-contiguous block tables, block size 4, prefill chunks then decode steps) and must give
the logits of a plain causal forward written here from the Hugging Face definitions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from mlx_infer.errors import InvalidCheckpoint, UnsupportedArchitecture
from mlx_infer.interface import kv as kv_cache
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import LayerKV
from mlx_infer.models import model_module

BLOCK = 4
NUM_BLOCKS = 24
TOL = 1e-4

_BASE = dict(
    hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=128
)
_GEMMA_TEXT = dict(
    _BASE, model_type="gemma3_text", num_hidden_layers=4, num_key_value_heads=1, head_dim=16,
    sliding_window=3, rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, query_pre_attn_scalar=24,
    rms_norm_eps=1e-6,
)

CONFIGS: dict[str, dict] = {
    "llama": dict(_BASE, model_type="llama", num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=False),
    # Qwen's optional sliding window, on the layers from max_window_layers on.
    "qwen2": dict(_BASE, model_type="qwen2", num_hidden_layers=2, rms_norm_eps=1e-6, rope_theta=1e6,
                  tie_word_embeddings=True, use_sliding_window=True, sliding_window=5, max_window_layers=1),
    "qwen3": dict(_BASE, model_type="qwen3", num_hidden_layers=2, head_dim=24, rms_norm_eps=1e-6,
                  rope_theta=1e6, tie_word_embeddings=False),
    # Both layer kinds, soft-capping, linear RoPE scaling on the global layers, untied head.
    "gemma3_text": dict(
        _GEMMA_TEXT, layer_types=["sliding_attention", "full_attention"] * 2,
        attn_logit_softcapping=5.0, final_logit_softcapping=3.0, tie_word_embeddings=False,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
    ),
    # The multimodal config layout: text_config nested, sliding_window_pattern instead of layer_types.
    "gemma3": dict(model_type="gemma3", vocab_size=128,
                   text_config=dict(_GEMMA_TEXT, sliding_window_pattern=2, num_hidden_layers=3)),
    "phi3": dict(_BASE, model_type="phi3", num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                 partial_rotary_factor=0.5, sliding_window=6, tie_word_embeddings=False),
    # LongRoPE (always the long factors) on a partial rotary head, with its attention factor.
    "phi3_longrope": dict(_BASE, model_type="phi3", num_hidden_layers=2, rms_norm_eps=1e-5, rope_theta=1e4,
                          partial_rotary_factor=0.5, tie_word_embeddings=True, max_position_embeddings=16384,
                          original_max_position_embeddings=4096,
                          rope_scaling={"type": "longrope", "long_factor": [1.0, 2.5, 4.0, 9.0],
                                        "short_factor": [1.0] * 4}),
    # Layer 1 dense through mlp_only_layers, layers 0 and 2 sparse.
    "qwen3_moe": dict(_BASE, model_type="qwen3_moe", num_hidden_layers=3, head_dim=16, rms_norm_eps=1e-6,
                      rope_theta=1e6, tie_word_embeddings=True, num_experts=6, num_experts_per_tok=2,
                      moe_intermediate_size=32, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    # decoder_sparse_step 2: only layer 1 sparse; unnormalised top-k weights.
    "qwen3_moe_step2": dict(_BASE, model_type="qwen3_moe", num_hidden_layers=2, head_dim=16,
                            rms_norm_eps=1e-6, rope_theta=1e6, tie_word_embeddings=False, num_experts=5,
                            num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=False,
                            decoder_sparse_step=2, mlp_only_layers=[]),
}


def text_config(cfg: dict) -> dict:
    return {**cfg["text_config"], "vocab_size": cfg["vocab_size"]} if "text_config" in cfg else cfg


def family(cfg: dict) -> str:
    return {"gemma3_text": "gemma3", "qwen3_moe": "qwen3"}.get(text_config(cfg)["model_type"],
                                                                text_config(cfg)["model_type"])


def head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def is_sparse(c: dict, i: int) -> bool:
    return (c["model_type"] == "qwen3_moe" and i not in c["mlp_only_layers"]
            and (i + 1) % c["decoder_sparse_step"] == 0)


def hf_weights(cfg: dict, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights under the names Hugging Face checkpoints use."""
    rng = np.random.default_rng(seed)
    c, fam = text_config(cfg), family(cfg)
    d, hd, i_dim = c["hidden_size"], head_dim(c), c["intermediate_size"]
    nh, nkv, v = c["num_attention_heads"], c["num_key_value_heads"], c["vocab_size"]
    w: dict[str, np.ndarray] = {}

    def mat(name: str, out: int, inp: int) -> None:
        w[name] = rng.normal(0, 1 / math.sqrt(inp), (out, inp))

    def norm(name: str, n: int) -> None:  # Gemma stores the scale as an offset from one
        w[name] = (0.0 if fam == "gemma3" else 1.0) + 0.2 * rng.normal(size=n)

    w["model.embed_tokens.weight"] = rng.normal(0, 1, (v, d))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if fam == "phi3":
            mat(p + "self_attn.qkv_proj.weight", (nh + 2 * nkv) * hd, d)
        else:
            for name, n in (("q", nh), ("k", nkv), ("v", nkv)):
                mat(p + f"self_attn.{name}_proj.weight", n * hd, d)
                if fam == "qwen2":
                    w[p + f"self_attn.{name}_proj.bias"] = 0.3 * rng.normal(size=n * hd)
        mat(p + "self_attn.o_proj.weight", d, nh * hd)
        if fam in ("qwen3", "gemma3"):
            norm(p + "self_attn.q_norm.weight", hd)
            norm(p + "self_attn.k_norm.weight", hd)
        norm(p + "input_layernorm.weight", d)
        norm(p + "post_attention_layernorm.weight", d)
        if fam == "gemma3":
            norm(p + "pre_feedforward_layernorm.weight", d)
            norm(p + "post_feedforward_layernorm.weight", d)
        if fam == "phi3":
            mat(p + "mlp.gate_up_proj.weight", 2 * i_dim, d)
            mat(p + "mlp.down_proj.weight", d, i_dim)
        elif is_sparse(c, i):
            mat(p + "mlp.gate.weight", c["num_experts"], d)
            for e in range(c["num_experts"]):
                mat(p + f"mlp.experts.{e}.gate_proj.weight", c["moe_intermediate_size"], d)
                mat(p + f"mlp.experts.{e}.up_proj.weight", c["moe_intermediate_size"], d)
                mat(p + f"mlp.experts.{e}.down_proj.weight", d, c["moe_intermediate_size"])
        else:
            mat(p + "mlp.gate_proj.weight", i_dim, d)
            mat(p + "mlp.up_proj.weight", i_dim, d)
            mat(p + "mlp.down_proj.weight", d, i_dim)
    norm("model.norm.weight", d)
    if not c.get("tie_word_embeddings", fam == "gemma3"):
        mat("lm_head.weight", v, d)
    w = {k: x.astype(np.float32) for k, x in w.items()}
    if "text_config" in cfg:  # Gemma3ForConditionalGeneration layout, with a vision tower to drop
        w = {"language_model." + k: x for k, x in w.items()}
        w["vision_tower.vision_model.post_layernorm.weight"] = np.ones(8, np.float32)
        w["multi_modal_projector.mm_input_projection_weight"] = np.ones((8, 8), np.float32)
    return w


# ----------------------------------------------------------------------------- NumPy oracle


def _rms(x: np.ndarray, w: np.ndarray, eps: float, gemma: bool) -> np.ndarray:
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * ((1.0 + w) if gemma else w)


def _rope(x: np.ndarray, pos: np.ndarray, dims: int, base: float, pos_scale: float,
          ext_factors: np.ndarray | float = 1.0, attention_factor: float = 1.0) -> np.ndarray:
    """Hugging Face's rotate_half RoPE on the first ``dims`` features of [T, H, D]."""
    inv = 1.0 / (ext_factors * base ** (np.arange(0, dims, 2) / dims))
    ang = (pos * pos_scale)[:, None, None] * inv[None, None, :]
    cos, sin = np.cos(ang) * attention_factor, np.sin(ang) * attention_factor
    half = dims // 2
    x1, x2, rest = x[..., :half], x[..., half:dims], x[..., dims:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def _silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


def _gelu_tanh(x: np.ndarray) -> np.ndarray:
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def oracle_logits(cfg: dict, weights: dict[str, np.ndarray], tokens: list[int]) -> np.ndarray:
    """Causal forward over the whole sequence, float64, from the HF-named weights: [T, vocab]."""
    c, fam = text_config(cfg), family(cfg)
    gemma = fam == "gemma3"
    w = {k.removeprefix("language_model."): x.astype(np.float64) for k, x in weights.items()}
    n, d, hd = len(tokens), c["hidden_size"], head_dim(c)
    nh, nkv, eps = c["num_attention_heads"], c["num_key_value_heads"], c["rms_norm_eps"]
    pos = np.arange(n, dtype=np.float64)
    x = w["model.embed_tokens.weight"][tokens]
    if gemma:
        x = x * np.float32(math.sqrt(d))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        a = _rms(x, w[p + "input_layernorm.weight"], eps, gemma)
        if fam == "phi3":
            qkv = a @ w[p + "self_attn.qkv_proj.weight"].T
            q, k, v = np.split(qkv, [nh * hd, (nh + nkv) * hd], axis=-1)
        else:
            q, k, v = (a @ w[p + f"self_attn.{m}_proj.weight"].T + w.get(p + f"self_attn.{m}_proj.bias", 0.0)
                       for m in "qkv")
        q, k, v = q.reshape(n, nh, hd), k.reshape(n, nkv, hd), v.reshape(n, nkv, hd)
        if fam in ("qwen3", "gemma3"):
            q = _rms(q, w[p + "self_attn.q_norm.weight"], eps, gemma)
            k = _rms(k, w[p + "self_attn.k_norm.weight"], eps, gemma)
        window, softcap, scale = None, None, hd**-0.5
        base, pos_scale, rot = c.get("rope_theta", 10000.0), 1.0, hd
        if gemma:
            types = c.get("layer_types") or [
                "sliding_attention" if (j + 1) % c["sliding_window_pattern"] else "full_attention"
                for j in range(c["num_hidden_layers"])
            ]
            softcap, scale = c.get("attn_logit_softcapping"), c["query_pre_attn_scalar"] ** -0.5
            if types[i] == "sliding_attention":
                window, base = c["sliding_window"], c["rope_local_base_freq"]
            elif c.get("rope_scaling"):
                pos_scale = 1.0 / c["rope_scaling"]["factor"]
        if fam == "qwen2" and c.get("use_sliding_window") and i >= c["max_window_layers"]:
            window = c["sliding_window"]
        ext, attn_factor = 1.0, 1.0
        if fam == "phi3":
            rot, window = int(hd * c["partial_rotary_factor"]), c.get("sliding_window")
            if c.get("rope_scaling"):  # longrope: factor = max / original positions
                ext = np.array(c["rope_scaling"]["long_factor"])
                ratio = c["max_position_embeddings"] / c["original_max_position_embeddings"]
                attn_factor = math.sqrt(1 + math.log(ratio) / math.log(c["original_max_position_embeddings"]))
        q = _rope(q, pos, rot, base, pos_scale, ext, attn_factor)
        k = _rope(k, pos, rot, base, pos_scale, ext, attn_factor)
        group = nh // nkv
        qi, kj = np.arange(n)[:, None], np.arange(n)[None, :]
        visible = kj <= qi
        if window is not None:
            visible &= kj > qi - window
        heads = []
        for h in range(nh):
            s = (q[:, h] @ k[:, h // group].T) * scale
            if softcap:
                s = np.tanh(s / softcap) * softcap
            s = np.where(visible, s, -np.inf)
            s = np.exp(s - s.max(-1, keepdims=True))
            heads.append((s / s.sum(-1, keepdims=True)) @ v[:, h // group])
        o = np.stack(heads, axis=1).reshape(n, nh * hd) @ w[p + "self_attn.o_proj.weight"].T
        if gemma:
            x = x + _rms(o, w[p + "post_attention_layernorm.weight"], eps, True)
            m_in = _rms(x, w[p + "pre_feedforward_layernorm.weight"], eps, True)
        else:
            x = x + o
            m_in = _rms(x, w[p + "post_attention_layernorm.weight"], eps, False)
        m = _mlp(c, fam, w, p, i, m_in)
        x = x + (_rms(m, w[p + "post_feedforward_layernorm.weight"], eps, True) if gemma else m)
    x = _rms(x, w["model.norm.weight"], eps, gemma)
    logits = x @ w.get("lm_head.weight", w["model.embed_tokens.weight"]).T
    if gemma and c.get("final_logit_softcapping"):
        cap = c["final_logit_softcapping"]
        logits = np.tanh(logits / cap) * cap
    return logits


def _mlp(c: dict, fam: str, w: dict, p: str, i: int, x: np.ndarray) -> np.ndarray:
    if fam == "phi3":
        gate, up = np.split(x @ w[p + "mlp.gate_up_proj.weight"].T, 2, axis=-1)
        return (_silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
    act = _gelu_tanh if fam == "gemma3" else _silu

    def expert(prefix: str, rows: np.ndarray) -> np.ndarray:
        h = act(rows @ w[prefix + "gate_proj.weight"].T) * (rows @ w[prefix + "up_proj.weight"].T)
        return h @ w[prefix + "down_proj.weight"].T

    if not is_sparse(c, i):
        return expert(p + "mlp.", x)
    logits = x @ w[p + "mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        top = np.argsort(-probs[t])[: c["num_experts_per_tok"]]
        scores = probs[t, top] / (probs[t, top].sum() if c["norm_topk_prob"] else 1.0)
        for e, s in zip(top, scores):
            out[t] += s * expert(p + f"mlp.experts.{e}.", x[t : t + 1])[0]
    return out


# ----------------------------------------------------------------------------- helpers


def build(cfg: dict, weights: dict[str, np.ndarray]) -> nn.Module:
    module = model_module(cfg["model_type"])
    model = module.Model(module.ModelArgs.from_dict(json.loads(json.dumps(cfg))))
    sanitized = model.sanitize({k: mx.array(x) for k, x in weights.items()})
    model.load_weights(list(sanitized.items()), strict=True)
    mx.eval(model.parameters())
    return model


def new_cache(
    model: nn.Module, num_blocks: int = NUM_BLOCKS, block: int = BLOCK, dtype=mx.float32
) -> list[LayerKV]:
    return kv_cache.new_cache(model, num_blocks, block, dtype)


def step(model, cache, slices: list[SequenceSlice], tokens: list[int]) -> np.ndarray:
    out = model(mx.array(tokens, dtype=mx.int32), cache, build_metadata(slices, BLOCK))
    return np.array(out.astype(mx.float32))


def write_word_tokenizer(folder: Path, vocab_size: int) -> None:
    """A minimal Hugging Face tokenizer (one word per id) so the folder is a complete model folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w1", "bos_token": "w2"}))


def tokens_for(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 128, n).tolist()


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request):
    cfg = CONFIGS[request.param]
    weights = hf_weights(cfg)
    return cfg, weights, build(cfg, weights)


# ----------------------------------------------------------------------------- tests


def test_incremental_paged_decode_matches_oracle(case):
    cfg, weights, model = case
    toks = tokens_for(1, 13)
    want = oracle_logits(cfg, weights, toks)
    table = [17, 3, 11, 6]  # permuted, non-contiguous physical blocks

    full = step(model, new_cache(model), [SequenceSlice(table, 0, len(toks), True)], toks)
    np.testing.assert_allclose(full, want, atol=TOL, rtol=0)

    cache, done, rows = new_cache(model), 0, []
    for n in (5, 1, 3, 1, 1, 2):  # a prefill chunk, decode steps, short chunks crossing block edges
        rows.append(step(model, cache, [SequenceSlice(table, done, n, True)], toks[done : done + n]))
        done += n
    np.testing.assert_allclose(np.concatenate(rows), want, atol=TOL, rtol=0)


def test_ragged_batch_equals_each_sequence_alone(case):
    _, _, model = case
    seqs = [tokens_for(2, 7), tokens_for(3, 5), tokens_for(4, 10)]
    tables = [[4, 9], [12, 1], [20, 7, 15]]
    computed = [6, 0, 4]  # a decode, a fresh prefill and a continued prefill chunk in one step

    alone = []
    for toks, table, c in zip(seqs, tables, computed):
        cache = new_cache(model)
        if c:
            step(model, cache, [SequenceSlice(table, 0, c)], toks[:c])
        alone.append(step(model, cache, [SequenceSlice(table, c, len(toks) - c)], toks[c:])[-1])

    cache = new_cache(model)
    for toks, table, c in zip(seqs, tables, computed):
        if c:
            step(model, cache, [SequenceSlice(table, 0, c)], toks[:c])
    slices = [SequenceSlice(t, c, len(s) - c) for s, t, c in zip(seqs, tables, computed)]
    batched = step(model, cache, slices, [tok for s, c in zip(seqs, computed) for tok in s[c:]])
    assert batched.shape == (3, 128)
    np.testing.assert_allclose(batched, np.stack(alone), atol=1e-5, rtol=0)


def test_save_and_reload_through_loader(case, tmp_path: Path):
    from mlx_infer.loading import load

    cfg, weights, model = case
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {k: mx.array(x) for k, x in weights.items()})
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    write_word_tokenizer(tmp_path, 128)
    loaded = load(str(tmp_path)).model
    toks = tokens_for(5, 9)
    slices = [SequenceSlice([2, 0, 5], 0, len(toks), True)]
    # The loader readies the model for the CPU (fused projections: other summation orders, test_fused.py's
    # tolerance); a wrong or missing weight would be off by far more.
    np.testing.assert_allclose(
        step(loaded, new_cache(loaded), slices, toks), step(model, new_cache(model), slices, toks),
        atol=2e-5, rtol=0,
    )


def test_unknown_model_type_names_supported_types():
    with pytest.raises(UnsupportedArchitecture) as err:
        model_module("mamba_gpt")
    for name in ("llama", "qwen2", "qwen3", "qwen3_moe", "gemma3_text", "gemma3", "phi3"):
        assert name in str(err.value)


def test_unimplemented_rope_scaling_is_refused():
    cfg = dict(CONFIGS["qwen2"], rope_scaling={"type": "dynamic", "factor": 4.0})
    with pytest.raises(UnsupportedArchitecture, match="dynamic"):
        model_module("qwen2").ModelArgs.from_dict(cfg)


def test_moe_missing_expert_is_an_invalid_checkpoint():
    cfg = CONFIGS["qwen3_moe"]
    weights = hf_weights(cfg)
    del weights["model.layers.2.mlp.experts.4.up_proj.weight"]
    with pytest.raises(InvalidCheckpoint, match="experts.4.up_proj"):
        build(cfg, weights)


def test_quantized_moe_experts_match_their_dequantized_weights():
    """nn.quantize turns the stacked experts into gather_qmm layers computing what they store."""
    cfg = CONFIGS["qwen3_moe"]
    model = build(cfg, hf_weights(cfg))
    nn.quantize(model, group_size=32, bits=8)
    mx.eval(model.parameters())
    switch = model.layers[0].mlp.switch_mlp
    dense = {}
    for i in (0, 2):
        for name in ("gate_proj", "up_proj", "down_proj"):
            q = getattr(model.layers[i].mlp.switch_mlp, name)
            dense[f"model.layers.{i}.mlp.switch_mlp.{name}.weight"] = mx.dequantize(
                q.weight, q.scales, q.biases, group_size=q.group_size, bits=q.bits
            )
    assert (switch.gate_proj.group_size, switch.gate_proj.bits) == (32, 8)
    reference = build(cfg, hf_weights(cfg))
    reference.load_weights(list(dense.items()), strict=False)
    # Only the experts are compared: quantize every other layer of the reference the same way.
    nn.quantize(reference, group_size=32, bits=8,
                class_predicate=lambda _, m: isinstance(m, (nn.Linear, nn.Embedding)))
    toks = tokens_for(6, 6)
    slices = [SequenceSlice([1, 3], 0, len(toks), True)]
    np.testing.assert_allclose(
        step(model, new_cache(model), slices, toks), step(reference, new_cache(reference), slices, toks),
        atol=1e-4, rtol=0,
    )
