"""The memory planner against hand-computed numbers and against what the engine allocates."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from mlx.utils import tree_flatten

from mlx_infer import cpu_kernels
from mlx_infer.plan import make_plan
from mlx_infer.plan.planner import BUDGET_ENV, KV_CACHE_DTYPES, kv_bytes_per_token, parse_bytes

# google/gemma-3-270m's config.json (the published values).
GEMMA3_270M = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 640,
    "intermediate_size": 2048, "num_hidden_layers": 18, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "vocab_size": 262144, "max_position_embeddings": 32768, "sliding_window": 512,
    "layer_types": ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0, "query_pre_attn_scalar": 256,
    "rms_norm_eps": 1e-06, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "rope_scaling": None, "torch_dtype": "bfloat16", "bos_token_id": 2,
    "eos_token_id": 1, "pad_token_id": 0, "_sliding_window_pattern": 6,
}  # fmt: skip
# meta-llama/Llama-3.1-70B-Instruct's config.json and its index's total size.
LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 500000.0,
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "attention_bias": False, "mlp_bias": False,
    "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu",
}  # fmt: skip
LLAMA_70B_TOTAL_SIZE = 141107412992
REPO = Path(__file__).resolve().parents[1]


def write_config(folder: Path, config: dict, total_size: int | None = None) -> Path:
    """A model folder with its config (and index) only: the metadata a Hub id's cache may hold."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if total_size is not None:
        index = {
            "metadata": {"total_size": total_size},
            "weight_map": {"lm_head.weight": "model-1.safetensors"},
        }
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", *args],
        capture_output=True, text=True, timeout=timeout, cwd=REPO, env={**os.environ, **(env or {})},
    )  # fmt: skip


def test_smollm2_by_hand(smollm2_path: Path):
    plan = make_plan(str(smollm2_path), context=1000, max_num_seqs=2, kv_cache_dtype="float16")
    # SmolLM2-135M: 30 layers, hidden 576, intermediate 1536, 9 heads, 3 KV heads of 64, vocab 49152, tied.
    # The GGUF holds every layer matrix as Q4_1, the embedding as Q8_0 and 61 norms as F32.
    layer = 2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576  # q, o; k, v; gate, up, down
    matrices, embedding, norms = 30 * layer, 49152 * 576, (2 * 30 + 1) * 576
    if cpu_kernels.applies():
        # Kept 4/8-bit for the native CPU kernels, group 32, with the GGUF's float16 scales and biases.
        expected = matrices // 2 + 2 * 2 * matrices // 32 + embedding + 2 * 2 * embedding // 32 + 4 * norms
        assert expected == 98_346_240
    else:  # dequantized to float32
        expected = 4 * (matrices + embedding + norms)
    assert plan.weights_bytes == expected
    assert plan.kv_bytes_per_token == 2 * 30 * 3 * 64 * 2 == 23_040
    assert plan.kv_bytes == 2 * 1008 * 23_040  # 1000 tokens take 63 blocks of 16
    assert plan.model_max_context == 8192
    assert plan.total_bytes == plan.weights_bytes + plan.kv_bytes + plan.scratch_bytes
    # Tied: the head reads the whole embedding every step, so every weight byte is read.
    bound = plan.bandwidth_bytes_s / (plan.weights_bytes + 1008 * 23_040)
    assert plan.decode_tok_s_bound == pytest.approx(bound)
    assert plan.decode_tok_s_bound_batch == pytest.approx(
        2 * plan.bandwidth_bytes_s / (plan.weights_bytes + 2 * 1008 * 23_040)
    )
    int8 = make_plan(str(smollm2_path), context=1000, kv_cache_dtype="int8")
    assert int8.kv_bytes_per_token == 2 * 30 * 3 * (64 + 4) == 12_240
    # --q-bits 8 widens the Q4_1 layers exactly at their group of 32 (convert keeps the source's group).
    eight = make_plan(str(smollm2_path), q_bits=8, backend="metal")
    assert eight.weights_bytes == (matrices + embedding) * (1 + 2 * 2 / 32) + 4 * norms


def test_gemma3_270m_by_hand(tmp_path: Path):
    folder = write_config(tmp_path / "gemma-3-270m", GEMMA3_270M)
    # embed 262144 x 640 (tied); per layer q 640->1024, k, v 640->256, o 1024->640, gate/up/down 640<->2048.
    layer = 640 * 1024 + 2 * 640 * 256 + 1024 * 640 + 3 * 640 * 2048
    matrices = 262144 * 640 + 18 * layer
    norms = 18 * (4 * 640 + 2 * 256) + 640  # four norms a block, q_norm and k_norm; the final norm
    assert matrices + norms == 268_098_176
    metal = make_plan(str(folder), context=4096, backend="metal")
    assert metal.weights_bytes == 2 * (matrices + norms)  # bfloat16 as stored
    assert metal.kv_cache_dtype == "bfloat16"  # auto on Metal: the compute dtype
    cpu = make_plan(str(folder), context=4096, backend="cpu")
    assert cpu.weights_bytes == 4 * (matrices + norms)  # widened to float32 for the BLAS
    assert cpu.kv_cache_dtype == "float16"
    # The 3 global layers hold the whole context, float16 K and V of one 256-wide head a token.
    assert cpu.kv_bytes_per_token == 3 * 2 * 1 * 256 * 2 == 3_072
    # The 15 sliding-window layers (window 512) have a pool of their own: one sequence's window spans
    # ceil(511 / 16) = 32 blocks, plus 3 partial ones, plus a 512-token step's 32 blocks.
    window_blocks = (32 + 3) + 512 // 16
    assert cpu.window_kv_bytes == window_blocks * 16 * 15 * 2 * 256 * 2 == 16_465_920
    assert cpu.kv_bytes == 4096 * 3_072 + 16_465_920
    # Eight sequences need eight windows, not eight contexts, of them.
    eight = make_plan(str(folder), context=4096, max_num_seqs=8, backend="cpu")
    assert eight.window_kv_bytes == (8 * 35 + 32) * 16 * 15 * 2 * 256 * 2
    # --q-bits 4: every matrix 4-bit in groups of 64 (640, 1024 and 2048 inputs all divide) with
    # bfloat16 scales and biases on Metal; norms stay bfloat16.
    q4 = make_plan(str(folder), q_bits=4, backend="metal")
    assert q4.weights_bytes == matrices // 2 + 2 * 2 * matrices // 64 + 2 * norms


def test_70b_from_its_config_alone(tmp_path: Path, monkeypatch):
    folder = write_config(tmp_path / "Llama-3.1-70B-Instruct", LLAMA_70B, LLAMA_70B_TOTAL_SIZE)
    monkeypatch.setenv(BUDGET_ENV, "192GiB")
    plan = make_plan(str(folder), context=8192, max_num_seqs=4, backend="metal")
    assert plan.weights_bytes == LLAMA_70B_TOTAL_SIZE  # bfloat16 as stored: the index's total size
    assert plan.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680
    assert plan.kv_bytes == 4 * 8192 * 327_680
    assert plan.budget_bytes == 192 * 2**30 and plan.fits
    assert 8192 <= plan.max_context_that_fits < plan.model_max_context == 131072
    # The most sequences of 8192 tokens does not depend on how many were asked for.
    assert plan.max_num_seqs_that_fit > 4 and all(
        make_plan(str(folder), context=8192, max_num_seqs=s, backend="metal").max_num_seqs_that_fit
        == plan.max_num_seqs_that_fit
        for s in (1, 1000, 100_000)
    )
    # Untied: one decode step reads every weight but the embedding table (a row of it).
    read = LLAMA_70B_TOTAL_SIZE - 128256 * 8192 * 2
    assert plan.decode_tok_s_bound == pytest.approx(plan.bandwidth_bytes_s / (read + 8192 * 327_680))
    # Past the model's context the engine caps it: the plan is at the model's, saying what was asked.
    longer = make_plan(str(folder), context=500_000, backend="metal")
    assert (longer.context, longer.context_requested) == (131072, 500_000)
    assert longer.kv_bytes == 131072 * 327_680 and plan.context_requested is None
    cpu = make_plan(str(folder), context=8192, backend="cpu")
    assert cpu.weights_bytes == 2 * LLAMA_70B_TOTAL_SIZE and not cpu.fits  # float32 here
    assert cpu.weights_fit is False and cpu.max_context_that_fits == 0


def test_the_default_kv_pool_is_a_share_of_the_memory_budget(monkeypatch):
    # MLX_INFER_MEMORY_BUDGET is the machine's memory for serve's default pool too, not only for plan,
    # the refusal and --kv-memory (a 114 MiB budget got a 5.6 GiB pool).
    from mlx_infer.kv.memory import DEFAULT_FRACTION, kv_budget_bytes

    monkeypatch.setenv(BUDGET_ENV, f"{mx.get_active_memory() + 40 * 2**20}")
    assert kv_budget_bytes(None) == pytest.approx(DEFAULT_FRACTION * 40 * 2**20, rel=0.05)
    monkeypatch.setenv(BUDGET_ENV, "1KiB")
    assert kv_budget_bytes(None) <= 256


def test_a_config_whose_dtype_is_unknown_is_planned_as_float32_and_says_so(tmp_path: Path, caplog):
    config = {**LLAMA_70B, "torch_dtype": "float8_e4m3fn"}
    plan = make_plan(str(write_config(tmp_path / "fp8-70b", config)), context=8192, backend="metal")
    assert plan.weights_bytes == 2 * LLAMA_70B_TOTAL_SIZE  # 4 bytes a parameter: the safe side of "fits"
    assert "'float8_e4m3fn' is not one of float64, float32, float16, bfloat16" in caplog.text
    caplog.clear()
    make_plan(str(write_config(tmp_path / "70b", LLAMA_70B)), context=8192, backend="metal")
    assert caplog.text == ""  # bfloat16 named: nothing to say


@pytest.fixture
def int8_activations():
    """The engine's default activations: the float32 ones conftest picks make a long prefill slow."""
    before = cpu_kernels.activations()
    cpu_kernels.set_activations("int8")
    yield
    cpu_kernels.set_activations(before if before in cpu_kernels.ACTIVATIONS else "int8")


def test_plan_matches_what_the_engine_allocates(smollm2_path: Path, int8_activations):
    """Planned weights + KV against ``mx.get_peak_memory`` after loading SmolLM2 and allocating the KV
    pool for a context; planned total against the peak of prefilling that context (in chunks of 512
    tokens, so the scratch of overlapped steps is in it). Within 10%."""
    from mlx_infer.engine.engine import Engine, EngineConfig
    from mlx_infer.loading import load
    from mlx_infer.sampling import SamplingParams

    context = 2048
    mx.clear_cache()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    loaded = load(str(smollm2_path))
    engine = Engine(
        loaded.model, loaded.tokenizer, loaded.max_context, EngineConfig(num_blocks=context // 16)
    )
    allocated = mx.get_peak_memory() - before
    # The pool's dtype, whichever the engine picks: the one whose bytes per token its blocks have.
    per_token = engine.kv_block_bytes // engine.config.block_size
    dtype = next(d for d in KV_CACHE_DTYPES[1:] if kv_bytes_per_token(30, 3, 64, d) == per_token)
    plan = make_plan(str(smollm2_path), context=context, kv_cache_dtype=dtype)
    assert plan.weights_bytes + plan.kv_bytes == pytest.approx(allocated, rel=0.10)

    mx.reset_peak_memory()
    engine.add_request(list(range(1, context - 8)), SamplingParams(max_tokens=2, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    peak = mx.get_peak_memory() - before
    print(
        f"planned {plan.weights_bytes + plan.kv_bytes} / {plan.total_bytes}, allocated {allocated}, "
        f"peak in prefill {peak}"
    )
    assert plan.total_bytes == pytest.approx(peak, rel=0.10)


def test_plan_cli_table_and_json(tmp_path: Path):
    folder = write_config(tmp_path / "gemma", GEMMA3_270M)
    table = cli("plan", "-m", str(folder), "--context", "2048", "--max-num-seqs", "3")
    assert table.returncode == 0, table.stderr
    for label in ("weights", "KV cache", "scratch", "total", "largest", "decode bound"):
        assert label in table.stdout
    result = cli("plan", "-m", str(folder), "--json", "--kv-cache-dtype", "int8", "--q-bits", "4")
    assert result.returncode == 0, result.stderr
    plan = json.loads(result.stdout)
    keys = ("weights_bytes", "kv_bytes_per_token", "kv_bytes", "total_bytes", "budget_bytes", "fits",
            "decode_tok_s_bound")  # fmt: skip
    assert all(k in plan for k in keys)
    # The three global layers' int8 rows; the sliding-window layers' pool is apart, fixed.
    assert plan["kv_bytes_per_token"] == kv_bytes_per_token(3, 1, 256, "int8") == 3 * 2 * (256 + 4)
    assert plan["window_kv_bytes"] == 67 * 16 * kv_bytes_per_token(15, 1, 256, "int8")


def test_the_plan_serve_logs_sets_its_kv_memory_against_the_plan(tmp_path: Path):
    from mlx_infer.plan_cli import render

    plan = make_plan(str(write_config(tmp_path / "gemma", GEMMA3_270M)), context=2048, max_num_seqs=3)
    given = render(plan, kv_memory_gib=0.05)
    tokens = int(0.05 * 2**30) // plan.kv_bytes_per_token
    assert f"(--kv-memory): about {tokens} tokens" in given and "pass --kv-memory" not in given


def test_plan_cli_errors_are_one_line(tmp_path: Path):
    for args in (["-m", str(tmp_path / "missing")], ["-m", str(tmp_path), "--context", "0"]):
        result = cli("plan", *args)
        assert result.returncode == 2
        assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
    folder = write_config(tmp_path / "gemma", GEMMA3_270M)
    bad = cli("plan", "-m", str(folder), env={BUDGET_ENV: "lots"})
    assert bad.returncode == 2 and "not a size" in bad.stderr
    # A file that is no model is a wrong path (2); a GGUF that is broken, a broken checkpoint (4).
    (tmp_path / "notes.json").write_text("{}")
    (tmp_path / "cut.gguf").write_bytes(b"GGUF\x03\x00")
    cases = (("notes.json", 2, "nor a model folder"), ("cut.gguf", 4, "ends inside its header"))
    for name, code, says in cases:
        result = cli("plan", "-m", str(tmp_path / name))
        assert result.returncode == code and says in result.stderr, result.stderr
        assert result.stderr.count("\n") == 1


def test_parse_bytes():
    assert parse_bytes("8GiB", "x") == 8 * 2**30
    assert parse_bytes("500 MB", "x") == 500 * 10**6
    assert parse_bytes("1000", "x") == 1000


def test_serve_refuses_a_model_whose_weights_do_not_fit(tiny_llama_folder: Path):
    result = cli("serve", "-m", str(tiny_llama_folder), "--port", "0", env={BUDGET_ENV: "1KiB"})
    assert result.returncode == 2, result.stderr
    assert "memory plan:" in result.stderr and "Traceback" not in result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("mlx-infer serve: error:")]
    assert len(error) == 1 and "does not fit" in error[0] and "1.0 KiB" in error[0]


def test_models_shows_what_fits(tmp_path: Path):
    own = tmp_path / "mine"
    write_config(own / "gemma", GEMMA3_270M)
    write_config(own / "llama-70b", LLAMA_70B, LLAMA_70B_TOTAL_SIZE)
    (own / "cut.gguf").write_bytes(b"GGUF\x03\x00")  # a download cut short
    write_config(own / "cut-safetensors", GEMMA3_270M)
    (own / "cut-safetensors" / "model.safetensors").write_bytes(b"\xff" * 8 + b"{")  # its header cut
    (own / "listed").mkdir()
    (own / "listed" / "config.json").write_text("[1, 2]")  # JSON, but no object
    env = {"MLX_INFER_CACHE": str(tmp_path / "cache"), "HF_HOME": str(tmp_path / "hf"), BUDGET_ENV: "16GiB"}
    result = cli("models", "--json", "--dir", str(own), env=env)
    assert result.returncode == 0, result.stderr
    rows = {Path(r["path"]).name: r for r in json.loads(result.stdout)}
    assert rows["gemma"]["fits"] is True and rows["gemma"]["max_context_that_fits"] == 32768
    assert rows["llama-70b"]["fits"] is False and rows["llama-70b"]["max_context_that_fits"] == 0
    assert rows["cut.gguf"]["fits"] is False
    assert rows["cut-safetensors"]["fits"] is False and rows["listed"]["fits"] is False
    table = cli("models", "--dir", str(own), env=env)
    assert table.returncode == 0 and "FITS" in table.stdout, table.stderr
    unreadable = {Path(line.split()[0]).name for line in table.stdout.splitlines() if "unreadable" in line}
    assert unreadable == {"cut.gguf", "cut-safetensors", "listed"}, table.stdout
    cut = cli("plan", "-m", str(own / "cut-safetensors"), env=env)
    assert cut.returncode == 4 and cut.stderr.count("\n") == 1 and "model.safetensors" in cut.stderr
    missing = cli("models", "--dir", str(own / "typo"), env=env)
    assert missing.returncode == 2 and "no such folder" in missing.stderr


Q4_GROUP_32 = {"group_size": 32, "bits": 4}


@pytest.mark.parametrize("keep_quantized", [None, False, True])
def test_planned_weights_equal_what_load_holds(tmp_path: Path, keep_quantized):
    """Tiny float32, bfloat16 and MLX 4-bit folders: the planned bytes are the loaded parameters' bytes
    under each weight policy (the safetensors headers name the dtypes, the config the quantization)."""
    from mlx_infer.loading import load

    model = make_tiny_llama(0)
    weights = dict(tree_flatten(model.parameters()))
    half = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    nn.quantize(model, group_size=32, bits=4)
    quantized = {
        k: v.astype(mx.bfloat16) if v.dtype == mx.float32 else v for k, v in tree_flatten(model.parameters())
    }
    folders = [
        write_hf_folder(tmp_path / "f32", weights, TINY_LLAMA_CONFIG),
        write_hf_folder(tmp_path / "bf16", half, {**TINY_LLAMA_CONFIG, "torch_dtype": "bfloat16"}),
        write_hf_folder(tmp_path / "q4", quantized, {**TINY_LLAMA_CONFIG, "quantization": Q4_GROUP_32}),
    ]  # fmt: skip
    for folder in folders:
        loaded = load(str(folder), keep_quantized=keep_quantized)
        held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        assert make_plan(str(folder), keep_quantized=keep_quantized).weights_bytes == held, folder.name


def test_a_hub_id_is_planned_from_cached_metadata(tmp_path: Path):
    """Only config.json in the Hugging Face cache, offline: enough for a plan."""
    snapshot = tmp_path / "hf" / "hub" / "models--acme--gemma" / "snapshots" / "0123abc"
    write_config(snapshot, GEMMA3_270M)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    result = cli("plan", "-m", "acme/gemma", "--json", "--context", "1024", env=env)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["weights_bytes"] == 4 * 268_098_176  # float32 on the CPU backend
    missing = cli("plan", "-m", "acme/other", env=env)
    assert missing.returncode == 2 and "not in the Hugging Face cache" in missing.stderr


@pytest.mark.parametrize("backend", ["cpu", "metal"])
def test_planned_gguf_weights_equal_what_load_holds(tmp_path: Path, monkeypatch, backend):
    """GGUF files of the mx.load types (Q8_0/Q4_0/Q4_1/F16/F32) and of K-quants with BF16 and Q8_0: the
    planned bytes are the loaded parameters' bytes, on the CPU backend and under Metal's policy (K-quant
    matrices as raw blocks, the rest re-quantized)."""
    import gguf
    from gguf.constants import GGMLQuantizationType as Q
    from test_loading import random_k_quant, write_tiny_gguf

    from mlx_infer.loading import load, policy
    from mlx_infer.metal_kernels import dispatch

    rng = np.random.default_rng(0)
    config = {**TINY_LLAMA_CONFIG, "hidden_size": 256, "intermediate_size": 512}  # K-quant rows: 256 values
    exact, kquants = {}, {}
    for i, (name, p) in enumerate(tree_flatten(make_tiny_llama(4, **config).parameters())):
        w = np.array(p)
        if w.ndim == 1:
            exact[name] = kquants[name] = (w, Q.F32)
            continue
        kind = [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.F16][i % 4]
        exact[name] = (gguf.quants.quantize(w, kind), kind)
        kind = [Q.Q4_K, Q.Q6_K, Q.BF16, Q.Q8_0][i % 4]
        data = (
            random_k_quant(kind, *w.shape, rng) if kind in (Q.Q4_K, Q.Q6_K) else gguf.quants.quantize(w, kind)
        )
        kquants[name] = (data, kind)
    write_tiny_gguf(tmp_path / "exact.gguf", config, exact)
    write_tiny_gguf(tmp_path / "kquants.gguf", config, kquants)
    if backend == "metal":
        monkeypatch.setattr(policy, "cpu_backend", lambda: False)
        monkeypatch.setattr(dispatch, "USE_KERNELS", True)
    for name in ("exact.gguf", "kquants.gguf"):
        loaded = load(str(tmp_path / name))
        held = sum(p.nbytes for _, p in tree_flatten(loaded.model.parameters()))
        assert make_plan(str(tmp_path / name), backend=backend).weights_bytes == held, (
            name,
            loaded.weight_policy,
        )


def test_bandwidth_from_apple_table_or_one_cached_measurement(tmp_path: Path, monkeypatch):
    from mlx_infer.plan import bandwidth

    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"device_name": "Apple M2 Pro"})
    assert bandwidth.memory_bandwidth() == (200e9, "Apple M2 Pro specification")
    monkeypatch.setattr(mx.metal, "device_info", lambda: {"device_name": "Apple M9"})  # unknown: measured
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    measured, source = bandwidth.memory_bandwidth()
    assert measured > 1e9 and str(tmp_path / "plan" / "bandwidth.json") in source

    def measure_again() -> float:
        raise AssertionError("measured twice")

    monkeypatch.setattr(bandwidth, "_measure", measure_again)
    assert bandwidth.memory_bandwidth()[0] == measured


def test_serve_counts_a_draft_models_weights(smollm2_path: Path):
    # SmolLM2's weights (93.8 MiB) fit 150 MiB; twice them, as model and draft, do not.
    args = ("serve", "-m", str(smollm2_path), "--draft-model", str(smollm2_path), "--port", "0")
    result = cli(*args, env={BUDGET_ENV: "150MiB"})
    assert result.returncode == 2, result.stderr
    assert "draft model" in result.stderr and "187.6 MiB" in result.stderr, result.stderr
    error = [line for line in result.stderr.splitlines() if line.startswith("mlx-infer serve: error:")]
    assert len(error) == 1 and "and its draft" in error[0], result.stderr
