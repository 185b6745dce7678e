"""DeepSeek V3 / Kimi K2 beyond the transformers comparison of test_architectures: the latent cache
(one row per token, no value pool) through every attention path and pool dtype, the Kimi K2 name,
and what tensor parallel refuses."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import write_hf_folder
from emulated import metal_kernels_emulated
from engine_helpers import CharTokenizer, greedy_reference
from mlx.utils import tree_flatten
from test_distributed import FakeGroup
from test_kernels import attention_case

from mlx_infer import cpu_kernels
from mlx_infer.distributed import shard_tensor
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.errors import DistributedError
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import new_cache, pool_rows
from mlx_infer.loading import load
from mlx_infer.metal_kernels import paged_attention as pa
from mlx_infer.metal_kernels import reference
from mlx_infer.metal_kernels.emulator import Emulator, toolchain_available
from mlx_infer.models.mla import QuantizedMultiLinear
from mlx_infer.plan import make_plan
from mlx_infer.sampling import SamplingParams

TINY = Path(__file__).parent / "oracle" / "tiny"
NAME = "deepseek_v3_no_q_lora"
BLOCK = 4


@pytest.fixture(scope="module")
def tiny():
    ref = np.load(TINY / NAME / "reference.npz")
    return load(str(TINY / NAME)).model, ref["tokens_0"], ref["logits_0"]


def prefill_then_decode(model, tokens, dtype=mx.float32) -> np.ndarray:
    """Logits of every position: a prefill chunk of all but three tokens, then one decode step each."""
    n_blocks = -(-len(tokens) // BLOCK) + 4
    cache = new_cache(model, n_blocks, BLOCK, dtype)
    table = [int(b) for b in np.random.default_rng(0).permutation(n_blocks)]
    done, rows = 0, []
    for n in [len(tokens) - 3, 1, 1, 1]:
        meta = build_metadata([SequenceSlice(table, done, n, True)], BLOCK)
        out = model(mx.array(tokens[done : done + n], dtype=mx.int32), cache, meta)
        rows.append(np.array(out.astype(mx.float32)))
        done += n
    return np.concatenate(rows)


def test_an_mla_layer_keeps_one_latent_row_per_token_and_no_value_pool(tiny):
    model, _, _ = tiny
    row = model.args.kv_lora_rank + model.args.qk_rope_head_dim
    for layer in new_cache(model, 8, BLOCK, mx.int8):
        assert [p.shape for p in layer.state()] == [(8 * BLOCK, 1, row + 4)]  # values, then the scale
        assert layer.values is layer.keys


@pytest.mark.parametrize("kv", ["float16", "bfloat16", "int8"])
def test_native_kernel_reads_each_latent_pool_dtype_as_the_reference(tiny, kv, monkeypatch):
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built here")
    model, tokens, want = tiny
    native = prefill_then_decode(model, tokens, getattr(mx, kv))
    monkeypatch.setattr(cpu_kernels, "applies", lambda: False)
    reference = prefill_then_decode(model, tokens, getattr(mx, kv))
    np.testing.assert_allclose(native, reference, atol=1e-4, rtol=0)
    # Lossy but close to transformers' float32 logits (measured 2.0e-3, 1.7e-2, 4.4e-2).
    assert np.abs(native - want).max() < {"float16": 5e-3, "bfloat16": 4e-2, "int8": 8e-2}[kv]


@pytest.mark.skipif(not toolchain_available(), reason="the emulator needs `pip install ziglang`")
def test_metal_kernel_runs_mla_as_transformers(tiny):
    """On a Mac the Metal paged-attention kernel attends the latent rows: run here by the emulator."""
    model, tokens, want = tiny
    with metal_kernels_emulated() as launched:
        got = prefill_then_decode(model, tokens)
    assert any("attention" in name for name in launched), launched
    assert np.abs(got - want).max() < 2e-4


def test_kimi_k2_loads_as_deepseek_v3(tiny, tmp_path: Path):
    """Kimi K2's config names its own model_type (transformers has no class for it); the weights are
    DeepSeek V3's."""
    folder = tmp_path / "kimi"
    shutil.copytree(TINY / NAME, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(dict(config, model_type="kimi_k2")))
    model, tokens, want = tiny
    kimi = load(str(folder)).model
    assert kimi.args.model_type == "kimi_k2"
    assert np.abs(prefill_then_decode(kimi, tokens) - want).max() < 2e-4


def test_tensor_parallel_splits_latent_attention_by_heads_into_partial_sums(tiny):
    """Each rank's MLA layer (its heads of q_proj, embed_q, unembed_out and o_proj's input) over a pool of
    every latent row gives a partial output; the two add up to the whole layer's. Both ranks keep one
    process's latent pools. (Whole models on two ranks: test_distributed.)"""
    full, _, _ = tiny
    x = mx.random.normal((9, full.args.hidden_size), key=mx.random.key(0))
    meta = build_metadata([SequenceSlice([2, 0, 1], 0, 9)], BLOCK)
    want = full.layers[0].self_attn(x, new_cache(full, 3, BLOCK, mx.float32)[0], meta)
    parts = []
    for rank in range(2):
        model = load(str(TINY / NAME)).model
        shard_tensor(model, FakeGroup(rank, 2))
        assert model.kv_layout() == full.kv_layout()
        attn = model.layers[0].self_attn.inner
        assert attn.n_heads == 2 and attn.embed_q.weight.shape[0] == 2
        parts.append(attn(x, new_cache(model, 3, BLOCK, mx.float32)[0], meta))
    np.testing.assert_allclose(np.array(parts[0] + parts[1]), np.array(want), atol=1e-5, rtol=0)
    with pytest.raises(DistributedError, match=r"attention heads \(4\) to divide by 3"):
        shard_tensor(load(str(TINY / NAME)).model, FakeGroup(0, 3))


def test_engine_with_latent_pools_preempts_and_answers_as_a_full_recompute(tiny):
    """The engine sizes and allocates the latent pools from kv_layout (one row a token and layer, no value
    pool), and greedy answers through chunked prefill, a ragged batch and preemption by recompute equal
    a full forward's."""
    model, _, _ = tiny
    config = EngineConfig(
        block_size=4, num_blocks=14, kv_cache_dtype="float32",
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )
    engine = Engine(model, CharTokenizer(), 256, config)
    row = model.args.kv_lora_rank + model.args.qk_rope_head_dim
    assert engine.kv_block_bytes == 4 * len(model.layers) * row * 4
    assert all(len(layer.state()) == 1 for layer in engine.runner.cache)
    prompts = [list(range(5, 19)), [3, 4, 5], list(range(40, 61)), [9] * 10]
    ids = [engine.add_request(p, SamplingParams(max_tokens=6, ignore_eos=True)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    assert engine.scheduler.num_preemptions > 0
    for i, prompt in zip(ids, prompts):
        assert out[i] == greedy_reference(model, prompt, 6, eos=None)


def test_plan_of_deepseek_v3_from_its_config(tmp_path: Path):
    """DeepSeek V3's published config: 61 layers of one 576-value latent row a token (512 + 64 rope)."""
    (tmp_path / "config.json").write_text(json.dumps(DEEPSEEK_V3))
    plan = make_plan(str(tmp_path), context=4096, backend="cpu")
    assert plan.kv_cache_dtype == "float16"
    assert plan.kv_bytes_per_token == 61 * 576 * 2 == 70_272  # full per-head K/V: 61 * 128 * (192 + 128) * 2
    assert make_plan(str(tmp_path), kv_cache_dtype="int8").kv_bytes_per_token == 61 * (576 + 4)
    assert 670e9 < plan.weights_bytes / 4 < 672e9  # 671B parameters (float32 on the CPU), MTP layer left out
    # A decode step reads the 37B activated parameters (8 of the 256 routed experts), not all of them.
    read = plan.bandwidth_bytes_s / plan.decode_tok_s_bound - 4096 * plan.kv_bytes_per_token
    assert 36e9 < read / 4 < 38e9


def test_plan_of_the_tiny_gguf_equals_what_load_holds():
    path = TINY / "deepseek_v3" / "model.f32.gguf"
    plan = make_plan(str(path), context=64, backend="cpu")
    loaded = load(str(path)).model
    assert plan.weights_bytes == sum(p.nbytes for _, p in tree_flatten(loaded.parameters()))
    assert plan.kv_bytes_per_token == 3 * (32 + 8) * 2  # three layers of latent rows, float16


# deepseek-ai/DeepSeek-V3's config.json (the published values; its FP8 quantization_config left out).
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
    "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "scoring_func": "sigmoid", "max_position_embeddings": 163840, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "vocab_size": 129280,
    "num_nextn_predict_layers": 1, "hidden_act": "silu", "bos_token_id": 0, "eos_token_id": 1,
}  # fmt: skip


def test_quantized_latent_projections_load_as_mlx_lm_writes_them(tmp_path: Path):
    """mlx-lm's quantized DeepSeek checkpoints carry ``embed_q`` / ``unembed_out`` quantized per head;
    they load into the same module tree and compute through ``mx.quantized_matmul``."""
    folder = TINY / "deepseek_v3"
    ref = np.load(folder / "reference.npz")
    model = load(str(folder)).model
    float_logits = prefill_then_decode(model, ref["tokens_0"])
    nn.quantize(model, group_size=32, bits=8, class_predicate=lambda p, m: p.endswith("unembed_out"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    quantized = write_hf_folder(tmp_path / "q8", dict(tree_flatten(model.parameters())), config)
    loaded = load(str(quantized)).model
    assert isinstance(loaded.model.layers[0].self_attn.unembed_out, QuantizedMultiLinear)
    got = prefill_then_decode(loaded, ref["tokens_0"])
    np.testing.assert_allclose(got, prefill_then_decode(model, ref["tokens_0"]), atol=1e-4, rtol=0)
    assert 0 < np.abs(got - float_logits).max() < 0.2  # 8-bit: measured 0.09


def test_pipeline_over_two_ranks_generates_what_one_process_does():
    """Pipeline parallel needs nothing of MLA: each rank allocates its layers' latent pools from the
    same kv_layout. Same greedy tokens and log-probabilities as one process."""
    worker = ["-m", "mlx_infer.distributed.worker", "-m", str(TINY / "deepseek_v3"), "-p", "w5 w9 w17 w33 w8",
              "--max-tokens", "6", "--no-chat-template", "--ignore-eos"]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    runs = [
        [sys.executable, *worker],
        [sys.executable, "-m", "mlx_infer.distributed.launch", "--hosts", "127.0.0.1,127.0.0.1", "--port",
         str(port), "--strategy", "pipeline", "--", "python", *worker],
    ]  # fmt: skip
    found = []
    for cmd in runs:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
        lines = [line for line in done.stdout.splitlines() if '"tokens"' in line]
        assert done.returncode == 0 and len(lines) == 1, done.stdout[-2000:] + done.stderr[-2000:]
        found.append(json.loads(lines[0].split("RESULT ", 1)[1]))
    one, pipeline = found
    assert pipeline["layers"] == 2 and pipeline["bytes_sent"] > 0  # rank 0's share of the 3 layers
    assert pipeline["tokens"] == one["tokens"] and pipeline["logprobs"] == one["logprobs"]


def test_gguf_written_by_llama_cpps_converter_equals_transformers():
    """``model.f32.gguf`` is the tiny checkpoint converted by llama.cpp's convert_hf_to_gguf.py
    (tests/oracle/make_tiny_gguf.py): its names (MLA's split attn_k_b / attn_v_b, stacked experts, the
    router bias), its metadata (MLA sizes, expert groups, YaRN's log multiplier) give transformers' logits."""
    folder = TINY / "deepseek_v3"
    ref = np.load(folder / "reference.npz")
    loaded = load(str(folder / "model.f32.gguf"))
    assert loaded.config["model_type"] == "deepseek_v3" and loaded.config["n_group"] == 4
    for i in range(2):
        got = prefill_then_decode(loaded.model, ref[f"tokens_{i}"])
        assert np.abs(got - ref[f"logits_{i}"]).max() < 2e-4


# ---- attention whose values are a prefix of the key rows (MLA), each path on its own ----------------
LATENT, ROPE = 32, 8


def latent_case(dtype: mx.Dtype, seed: int = 0):
    """8 query heads over one "KV head" of 40-wide rows (a 32-wide latent, then 8 rope values): decodes
    at several context lengths and a 5-token chunk after 35 cached tokens, over scattered blocks."""
    contexts, queries = [1, 15, 17, 300, 40], [1, 1, 1, 1, 5]
    q, k, _, meta = attention_case(contexts, queries, 8, 1, LATENT + ROPE, mx.float32, seed)
    return q, pool_rows(k, dtype), meta


def numpy_latent_attention(q: mx.array, pool: mx.array, meta, scale: float) -> np.ndarray:
    queries, rows = np.array(q), np.array(pool)[:, 0]
    slots, positions = np.array(meta.key_slots), np.array(meta.positions)
    out, t = [], 0
    for seq, n in enumerate(meta.query_lens):
        for _ in range(n):
            keys = rows[slots[seq, : positions[t] + 1]]
            scores = scale * queries[t] @ keys.T
            w = np.exp(scores - scores.max(-1, keepdims=True))
            out.append((w / w.sum(-1, keepdims=True)) @ keys[:, :LATENT])
            t += 1
    return np.stack(out)


def test_reference_reads_values_out_of_the_key_rows():
    q, pool, meta = latent_case(mx.float32)
    out = reference.paged_attention(q, pool, pool, meta, 0.2, value_dim=LATENT)
    assert out.shape == (q.shape[0], 8, LATENT)
    np.testing.assert_allclose(np.array(out), numpy_latent_attention(q, pool, meta, 0.2), atol=2e-5, rtol=0)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int8])
def test_native_kernel_reads_values_out_of_the_key_rows_as_the_reference(dtype):
    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built here")
    q, pool, meta = latent_case(dtype, seed=1)
    expect = reference.paged_attention(q, pool, pool, meta, 0.2, value_dim=LATENT)
    out = cpu_kernels.paged_attention(q, pool, pool, meta, 0.2, value_dim=LATENT)
    np.testing.assert_allclose(np.array(out), np.array(expect), rtol=1e-4, atol=5e-6)


@pytest.mark.skipif(not toolchain_available(), reason="the emulator needs `pip install ziglang`")
@pytest.mark.parametrize("partition_keys", [None, 64])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.int8])
def test_metal_kernel_reads_values_out_of_the_key_rows_as_the_reference(dtype, partition_keys):
    """The kernel body run by the emulator, whole and split-KV (partials and their reduce)."""
    q, pool, meta = latent_case(dtype, seed=2)
    expect = reference.paged_attention(q, pool, pool, meta, 0.2, value_dim=LATENT)
    out = pa.paged_attention(q, pool, pool, meta, 0.2, value_dim=LATENT, launch=Emulator().launch,
                             partition_keys=partition_keys)
    assert out.shape == expect.shape
    assert float(mx.abs(out - expect).max()) < 5e-6
