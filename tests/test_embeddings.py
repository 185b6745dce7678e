"""Embeddings: BERT encoders against sentence-transformers, decoders against a NumPy forward, batching,
``POST /v1/embeddings`` with the official openai client, hostile inputs, and ``mlx-infer embed``."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from mlx_infer.embedding import is_embedding_model, load_embedding_model, pool
from mlx_infer.errors import InvalidRequest
from mlx_infer.models import model_module
from tests.conftest import write_tiny_tokenizer
from tests.server_helpers import LiveServer

REFERENCES = json.loads((Path(__file__).parent / "oracle/minilm_embeddings.json").read_text(encoding="utf-8"))
SENTENCES = [s["text"] for s in REFERENCES["sentences"]]
BATCH = (4096, 32)  # padded tokens and inputs per forward, as `mlx-infer embed` uses them

TINY_QWEN3 = dict(
    model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=96, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, vocab_size=64, max_position_embeddings=128, rope_theta=10000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True,
)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ---- decoders (Qwen3-Embedding style) against NumPy ---------------------------------------------------
def _tiny_qwen3_weights(seed: int = 0) -> dict[str, np.ndarray]:
    module = model_module("qwen3")
    model = module.Model(module.ModelArgs.from_dict(TINY_QWEN3))
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            weights[name] = (1 + 0.1 * rng.standard_normal(p.shape)).astype(np.float32)
        else:
            weights[name] = (0.3 * rng.standard_normal(p.shape)).astype(np.float32)
    return weights


def _write_st_decoder(folder: Path, weights: dict[str, np.ndarray]) -> Path:
    """A Qwen3-Embedding-style sentence-transformers folder: bare Qwen3Model names (no ``model.``
    prefix, no head), last-token pooling, Normalize."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(TINY_QWEN3))
    bare = {k.removeprefix("model."): mx.array(v) for k, v in weights.items()}
    mx.save_safetensors(str(folder / "model.safetensors"), bare)
    write_tiny_tokenizer(folder)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (folder / "modules.json").write_text(json.dumps(modules))
    (folder / "1_Pooling").mkdir()
    pooling = {"pooling_mode_lasttoken": True, "pooling_mode_cls_token": False}
    (folder / "1_Pooling/config.json").write_text(json.dumps(pooling))
    return folder


def _numpy_qwen3_embedding(w: dict[str, np.ndarray], ids: list[int]) -> np.ndarray:
    """Qwen3 forward in float64 NumPy, final norm, last token, unit length."""
    c = TINY_QWEN3
    heads, kv_heads, hd = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    eps = c["rms_norm_eps"]
    w = {k: v.astype(np.float64) for k, v in w.items()}

    def rms(x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * weight

    def rope(x):  # [T, H, D], rotate-half layout
        t = np.arange(x.shape[0])[:, None]
        inv = c["rope_theta"] ** (-np.arange(0, hd, 2) / hd)
        ang = np.concatenate([t * inv, t * inv], axis=-1)[:, None, :]
        half = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
        return x * np.cos(ang) + half * np.sin(ang)

    n = len(ids)
    x = w["model.embed_tokens.weight"][ids]
    causal = np.tril(np.ones((n, n), dtype=bool))
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(n, heads, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(n, kv_heads, hd)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(n, kv_heads, hd)
        q = rope(rms(q, w[p + "self_attn.q_norm.weight"]))
        k = rope(rms(k, w[p + "self_attn.k_norm.weight"]))
        k, v = np.repeat(k, heads // kv_heads, axis=1), np.repeat(v, heads // kv_heads, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd)
        scores = np.where(causal, scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, heads * hd)
        x = x + attn @ w[p + "self_attn.o_proj.weight"].T
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        gate, up = h @ w[p + "mlp.gate_proj.weight"].T, h @ w[p + "mlp.up_proj.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * up) @ w[p + "mlp.down_proj.weight"].T
    last = rms(x, w["model.norm.weight"])[-1]
    return last / np.linalg.norm(last)


@pytest.fixture(scope="module")
def tiny_decoder(tmp_path_factory):
    weights = _tiny_qwen3_weights()
    return _write_st_decoder(tmp_path_factory.mktemp("emb") / "tiny-qwen3-embedding", weights), weights


def test_decoder_embeddings_match_numpy_and_batching(tiny_decoder):
    folder, weights = tiny_decoder
    assert is_embedding_model(str(folder))
    model = load_embedding_model(str(folder))
    assert (model.pooling.mode, model.pooling.normalize, model.dimension) == ("last", True, 64)
    inputs = [[5, 9, 13, 2, 40], list(range(3, 40)), [7], list(range(60, 3, -3))]
    batched = model.embed(inputs, *BATCH)
    for ids, got in zip(inputs, batched):
        want = _numpy_qwen3_embedding(weights, ids)
        np.testing.assert_allclose(got, want, atol=2e-5)
        alone = model.embed([ids], *BATCH)[0]
        np.testing.assert_allclose(alone, got, atol=1e-6)
    # Several forwards (one input each) give the vectors of one forward over all of them.
    np.testing.assert_allclose(model.embed(inputs, 64, 1), batched, atol=1e-6)


def test_decoder_is_an_embedding_model_only_when_told(tiny_llama_folder):
    assert not is_embedding_model(str(tiny_llama_folder))
    with pytest.raises(InvalidRequest, match="not an embedding model"):
        load_embedding_model(str(tiny_llama_folder))
    model = load_embedding_model(str(tiny_llama_folder), pooling="mean")
    vectors = model.embed([[4, 5, 6], [7]], *BATCH)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5)


def test_dimensions_only_where_matryoshka(tiny_decoder):
    model = load_embedding_model(str(tiny_decoder[0]))
    full = model.embed([[5, 6, 7]], *BATCH)
    cut = model.resize(full, 16)
    np.testing.assert_allclose(cut[0], full[0, :16] / np.linalg.norm(full[0, :16]), rtol=1e-6)
    with pytest.raises(InvalidRequest, match="exceeds"):
        model.check_dimensions(65)


def test_pooling_modes_on_a_padded_batch():
    rng = np.random.default_rng(1)
    hidden = rng.standard_normal((3, 5, 4)).astype(np.float32)
    lengths = np.array([5, 2, 1], dtype=np.int32)
    h = mx.array(hidden)
    np.testing.assert_allclose(np.array(pool(h, lengths, "cls")), hidden[:, 0])
    np.testing.assert_allclose(np.array(pool(h, lengths, "last")), hidden[[0, 1, 2], lengths - 1])
    means = np.stack([hidden[i, :n].mean(0) for i, n in enumerate(lengths)])
    np.testing.assert_allclose(np.array(pool(h, lengths, "mean")), means, rtol=1e-5, atol=1e-6)


# ---- all-MiniLM-L6-v2 against sentence-transformers ---------------------------------------------------
@pytest.fixture(scope="module")
def minilm(minilm_path):
    return load_embedding_model(str(minilm_path))


def test_minilm_matches_sentence_transformers(minilm):
    assert (minilm.pooling.mode, minilm.pooling.normalize) == ("mean", True)
    assert (minilm.dimension, minilm.max_tokens) == (REFERENCES["dimension"], REFERENCES["max_seq_length"])
    inputs = minilm.tokenize(SENTENCES)
    assert inputs == [s["ids"] for s in REFERENCES["sentences"]]
    vectors = minilm.embed(inputs, *BATCH)
    for sentence, got in zip(REFERENCES["sentences"], vectors):
        assert cosine(got, np.array(sentence["embedding"])) >= 0.9999, sentence["text"]


def test_minilm_batching_equals_one_at_a_time(minilm):
    inputs = minilm.tokenize(SENTENCES)
    batched = minilm.embed(inputs, *BATCH)
    for ids, got in zip(inputs, batched):
        np.testing.assert_allclose(minilm.embed([ids], *BATCH)[0], got, atol=1e-5)


# ---- POST /v1/embeddings -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def minilm_server(minilm_path):
    server = LiveServer(minilm_path, name="minilm")
    yield server
    server.stop()


def test_openai_client_float_and_base64(minilm_server):
    import openai

    client = openai.OpenAI(base_url=f"{minilm_server.base_url}/v1", api_key="unused")
    refs = [np.array(s["embedding"]) for s in REFERENCES["sentences"]]
    plain = client.embeddings.create(model="minilm", input=SENTENCES, encoding_format="float")
    # Without encoding_format the client asks for base64 and decodes it itself.
    decoded = client.embeddings.create(model="minilm", input=SENTENCES)
    for result in (plain, decoded):
        assert [d.index for d in result.data] == list(range(len(SENTENCES)))
        for d, ref in zip(result.data, refs):
            assert cosine(np.array(d.embedding), ref) >= 0.9999
    assert plain.usage.prompt_tokens == sum(len(s["ids"]) for s in REFERENCES["sentences"])
    np.testing.assert_allclose(
        np.array([d.embedding for d in plain.data]), np.array([d.embedding for d in decoded.data]), atol=1e-6
    )
    raw = client.embeddings.create(model="minilm", input=SENTENCES[0], encoding_format="base64")
    vector = np.frombuffer(base64.b64decode(raw.data[0].embedding), dtype="<f4")
    np.testing.assert_allclose(vector, plain.data[0].embedding, atol=1e-6)
    # /v1/models reports the longest input embedded (sentence-transformers' max_seq_length, 256), not the
    # encoder's 512 positions.
    card = client.models.retrieve("minilm")
    assert [m.id for m in client.models.list().data] == ["minilm"] and card.context_length == 256
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


def test_token_id_inputs_equal_text_inputs(minilm_server):
    url = f"{minilm_server.base_url}/v1/embeddings"
    ids = [s["ids"] for s in REFERENCES["sentences"][:3]]
    by_text = httpx.post(url, json={"model": "minilm", "input": SENTENCES[:3]}, timeout=60).json()
    by_ids = httpx.post(url, json={"model": "minilm", "input": ids}, timeout=60).json()
    one = httpx.post(url, json={"model": "minilm", "input": ids[1]}, timeout=60).json()
    for a, b in zip(by_text["data"], by_ids["data"]):
        np.testing.assert_allclose(a["embedding"], b["embedding"], atol=1e-6)
    np.testing.assert_allclose(one["data"][0]["embedding"], by_ids["data"][1]["embedding"], atol=1e-5)
    assert one["usage"] == {"prompt_tokens": len(ids[1]), "total_tokens": len(ids[1])}


HOSTILE = [
    ({"model": "minilm"}, 400, "input"),
    ({"model": "minilm", "input": ""}, 400, "empty"),
    ({"model": "minilm", "input": []}, 400, "input"),
    ({"model": "minilm", "input": ["a", ""]}, 400, "empty"),
    ({"model": "minilm", "input": [[]]}, 400, "input"),
    ({"model": "minilm", "input": [[1, 2], "x"]}, 400, "input"),
    ({"model": "minilm", "input": [1, "a"]}, 400, "input"),
    ({"model": "minilm", "input": [True, False]}, 400, "input"),
    ({"model": "minilm", "input": {"text": "a"}}, 400, "input"),
    ({"model": "minilm", "input": 5}, 400, "input"),
    ({"model": "minilm", "input": [-1, 5]}, 400, "token ids"),
    ({"model": "minilm", "input": [[101, 10**9]]}, 400, "token ids"),
    ({"model": "minilm", "input": "word " * 400}, 400, "at most 256"),
    ({"model": "minilm", "input": ["ok", "word " * 400]}, 400, "input[1] has"),
    ({"model": "minilm", "input": ["a"] * 2049}, 400, "at most 2048"),
    ({"model": "minilm", "input": "a", "encoding_format": "hex"}, 400, "encoding_format"),
    ({"model": "minilm", "input": "a", "dimensions": 0}, 400, "dimensions"),
    ({"model": "minilm", "input": "a", "dimensions": 100}, 400, "Matryoshka"),
    ({"model": "minilm", "input": "a", "dimensions": 385}, 400, "exceeds"),
    ({"model": "minilm", "input": "a", "dimensions": "ten"}, 400, "dimensions"),
    ({"model": "other", "input": "a"}, 404, "other"),
]


def test_hostile_inputs_get_4xx_and_the_server_stays_healthy(minilm_server):
    url = f"{minilm_server.base_url}/v1/embeddings"
    for body, status, words in HOSTILE:
        r = httpx.post(url, json=body, timeout=60)
        assert r.status_code == status, (body, r.text)
        error = r.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error", (body, error)
    assert httpx.post(url, content=b"{not json", timeout=10).status_code == 400
    chat = httpx.post(
        f"{minilm_server.base_url}/v1/chat/completions",
        json={"model": "minilm", "messages": [{"role": "user", "content": "hi"}]},
        timeout=10,
    )
    assert chat.status_code == 400 and "embedding model" in chat.json()["error"]["message"]
    # Anthropic's Messages API asked of it: a 400 in Anthropic's shape, and no model to list there.
    anthropic_headers = {"anthropic-version": "2023-06-01"}
    messages = httpx.post(
        f"{minilm_server.base_url}/v1/messages",
        json={"model": "minilm", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
        headers=anthropic_headers,
        timeout=10,
    )
    assert messages.status_code == 400 and messages.json()["type"] == "error", messages.text
    assert "embedding model" in messages.json()["error"]["message"]
    listed = httpx.get(f"{minilm_server.base_url}/v1/models", headers=anthropic_headers, timeout=10).json()
    assert listed == {"data": [], "has_more": False, "first_id": None, "last_id": None}
    openai_listed = httpx.get(f"{minilm_server.base_url}/v1/models", timeout=10).json()["data"]
    assert [(m["id"], m["type"]) for m in openai_listed] == [("minilm", "embeddings")]
    nowhere = httpx.get(f"{minilm_server.base_url}/v1/nowhere", headers=anthropic_headers, timeout=10)
    assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"
    assert httpx.post(f"{minilm_server.base_url}/v1/nowhere", json={}, timeout=10).status_code == 404
    assert httpx.get(f"{minilm_server.base_url}/health", timeout=10).json() == {"status": "ok"}
    ok = httpx.post(url, json={"model": "minilm", "input": "still fine"}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["data"][0]["embedding"]) == 384
    metrics = minilm_server.metrics()
    assert metrics["mlx_infer_requests_pending"] == 0 and metrics["mlx_infer_embedding_inputs_total"] >= 1


def test_a_generation_model_answers_embeddings_with_400(tiny_llama_folder):
    server = LiveServer(tiny_llama_folder, name="tiny")
    try:
        r = httpx.post(f"{server.base_url}/v1/embeddings", json={"model": "tiny", "input": "w1"}, timeout=10)
        assert r.status_code == 400 and "computes no embeddings" in r.json()["error"]["message"]
        assert httpx.get(f"{server.base_url}/health", timeout=10).status_code == 200
    finally:
        server.stop()


# ---- mlx-infer embed ------------------------------------------------------------------------------------
def _embed_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", "embed", *args], capture_output=True, text=True, timeout=120
    )


def test_embed_cli_prints_vectors_and_json(minilm_path):
    done = _embed_cli("-m", str(minilm_path), "--json", SENTENCES[0], SENTENCES[6])
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["model"] == minilm_path.name  # the name serve gives it, not the path
    for d, ref in zip(body["data"], (REFERENCES["sentences"][0], REFERENCES["sentences"][6])):
        assert cosine(np.array(d["embedding"]), np.array(ref["embedding"])) >= 0.9999
    lines = _embed_cli("-m", str(minilm_path), SENTENCES[1]).stdout.splitlines()
    assert len(lines) == 1
    vector = np.array([float(x) for x in lines[0].split()])
    assert cosine(vector, np.array(REFERENCES["sentences"][1]["embedding"])) >= 0.9999


def test_embed_cli_errors_are_one_line(minilm_path, tiny_llama_folder):
    for args, words in [
        (("-m", str(minilm_path)), "no text"),
        (("-m", str(minilm_path), "word " * 400), "at most 256"),
        (("-m", str(minilm_path), "--dimensions", "10", "hi"), "Matryoshka"),
        (("-m", str(tiny_llama_folder), "w1"), "not an embedding model"),
    ]:
        done = _embed_cli(*args)
        assert done.returncode == 2, (args, done.stderr)
        assert done.stderr.count("\n") == 1 and words in done.stderr, done.stderr


def test_serve_refuses_speculation_for_an_embedding_model(minilm_path):
    done = subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", "serve", "-m", str(minilm_path), "--speculative", "ngram"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert "nothing to speculate on" in done.stderr
