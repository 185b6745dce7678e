"""Server error paths, authentication and back-pressure (in process, tiny random model), failures inside
the engine, the serve process's life (503 while loading, graceful shutdown, exit when the engine stops;
live servers on the tiny model), and preemption under a KV pool too small for the running requests (a
live server on SmolLM2)."""

from __future__ import annotations

import asyncio
import itertools
import json
import signal
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from mlx.utils import tree_flatten
from server_helpers import LiveServer, kv_gib_for_blocks, wait_for_idle
from starlette.testclient import TestClient

from mlx_infer.engine.async_engine import AsyncEngine
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.errors import EngineFailure
from mlx_infer.sampling import SamplingParams
from mlx_infer.server.app import OpenAIServer, ServerConfig
from mlx_infer.server.request_body import MAX_NESTING_DEPTH

pytestmark = pytest.mark.timeout(300)

CONTEXT = TINY_LLAMA_CONFIG["max_position_embeddings"]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GOOD_CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "w1 w2 w3"}], "max_tokens": 4}
GOOD_COMPLETION = {"model": "tiny", "prompt": "w1 w2 w3", "max_tokens": 4}
API_KEY = "sekrit"


def _chat(**changes) -> dict:
    return {**GOOD_CHAT, **changes}


def _completion(**changes) -> dict:
    return {**GOOD_COMPLETION, **changes}


W1 = {"role": "user", "content": "w1"}
CALLED = {
    "role": "assistant",
    "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
}


def _tool_result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "w2"}


# (method, path, body: dict to send as JSON or raw bytes or None, expected status)
BAD_REQUESTS: list[tuple[str, str, object, int]] = [
    # malformed JSON and non-object bodies
    ("POST", CHAT, b"{", 400),
    ("POST", CHAT, b"{'model': 'tiny'}", 400),
    ("POST", CHAT, b"", 400),
    ("POST", CHAT, b"\xff\xfe\x00", 400),
    ("POST", CHAT, b"null", 400),
    ("POST", CHAT, b"[]", 400),
    ("POST", COMPLETIONS, b'"just a string"', 400),
    ("POST", COMPLETIONS, b"42", 400),
    # half an emoji (an unpaired UTF-16 surrogate), which no tokenizer encodes
    ("POST", CHAT, b'{"model": "tiny", "messages": [{"role": "user", "content": "w1 \\ud83d w2"}]}', 400),
    ("POST", COMPLETIONS, b'{"model": "tiny", "prompt": "\\ud83d"}', 400),
    # missing and wrongly typed fields
    ("POST", CHAT, _chat(model="another-model"), 404),  # (leaving model out is fine: one is served)
    ("POST", CHAT, {"model": "tiny"}, 400),
    ("POST", CHAT, _chat(model=5), 400),
    ("POST", CHAT, _chat(messages="w1 w2"), 400),
    ("POST", CHAT, _chat(messages=[{"role": "user", "content": 5}]), 400),
    ("POST", CHAT, _chat(messages=[{"role": "robot", "content": "w1"}]), 400),
    # a tool result answering no call of the assistant message before, and a call left unanswered
    ("POST", CHAT, _chat(messages=[W1, _tool_result("c1")]), 400),
    ("POST", CHAT, _chat(messages=[W1, CALLED, W1]), 400),
    ("POST", CHAT, _chat(messages=[W1, CALLED, _tool_result("c2")]), 400),
    ("POST", CHAT, _chat(messages=[{"content": "w1"}]), 400),
    (
        "POST",
        CHAT,
        _chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
    ),
    # an assistant's tool_calls that are not a list of calls, a text part without its text
    *(
        ("POST", CHAT, _chat(messages=[W1, {"role": "assistant", "content": "w2", "tool_calls": c}, W1]), 400)
        for c in ("x", 5, {"id": "c1"}, ["c1"], [None], [{"id": "c1", "type": "function", "function": "f"}])
    ),
    ("POST", CHAT, _chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400),
    ("POST", CHAT, _chat(temperature="hot"), 400),
    ("POST", CHAT, _chat(max_tokens="many"), 400),
    ("POST", CHAT, _chat(max_tokens=1.5), 400),
    ("POST", CHAT, _chat(stream=[1]), 400),
    ("POST", CHAT, _chat(stop=5), 400),
    ("POST", CHAT, _chat(stop=["w1"] * 17), 400),
    ("POST", CHAT, _chat(n="two"), 400),
    ("POST", CHAT, _chat(seed="x"), 400),
    ("POST", CHAT, _chat(stream_options="x"), 400),
    ("POST", CHAT, _chat(logprobs=True, top_logprobs=21), 400),
    ("POST", CHAT, _chat(logprobs=True, top_logprobs=-1), 400),
    ("POST", COMPLETIONS, _completion(prompt=5), 400),
    ("POST", COMPLETIONS, _completion(prompt=""), 400),
    ("POST", COMPLETIONS, _completion(prompt=[]), 400),
    ("POST", COMPLETIONS, _completion(prompt=[10**6]), 400),
    ("POST", COMPLETIONS, _completion(prompt=[-1]), 400),
    ("POST", COMPLETIONS, _completion(logprobs=21), 400),
    # empty messages; out-of-range numbers
    ("POST", CHAT, _chat(messages=[]), 400),
    ("POST", CHAT, _chat(max_tokens=-1), 400),
    ("POST", CHAT, _chat(max_tokens=0), 400),
    ("POST", CHAT, _chat(max_tokens=10**30), 400),
    ("POST", CHAT, _chat(max_completion_tokens=-5), 400),
    ("POST", COMPLETIONS, _completion(max_tokens=-1), 400),
    ("POST", CHAT, _chat(n=0), 400),
    ("POST", CHAT, _chat(n=17), 400),
    ("POST", CHAT, _chat(temperature=5), 400),
    ("POST", CHAT, _chat(temperature=-1), 400),
    (
        "POST",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "temperature": NaN}',
        400,
    ),
    ("POST", CHAT, _chat(top_p=0), 400),
    ("POST", CHAT, _chat(top_p=1.5), 400),
    ("POST", CHAT, _chat(min_p=2), 400),
    ("POST", CHAT, _chat(presence_penalty=3), 400),
    ("POST", CHAT, _chat(repetition_penalty=0), 400),
    ("POST", CHAT, _chat(repetition_penalty=1e300), 400),
    ("POST", CHAT, _chat(top_k=-1), 400),
    ("POST", CHAT, _chat(top_k=10**30), 400),
    ("POST", CHAT, _chat(seed=1.5), 400),
    ("POST", CHAT, _chat(stop=["w" * 1025]), 400),
    ("POST", CHAT, json.dumps(GOOD_CHAT).encode()[:-1] + b', "logit_bias": {"5": 1e400}}', 400),
    (
        "POST",
        CHAT,
        b'{"model": "tiny", "messages": [{"role": "user", "content": "w1"}], "top_p": Infinity}',
        400,
    ),
    ("POST", COMPLETIONS, _completion(prompt=[10**30]), 400),
    ("POST", CHAT, json.dumps(GOOD_CHAT).encode()[:-1] + b', "seed": 1' + b"0" * 5000 + b"}", 400),
    # nesting and size: refused before parsing
    ("POST", CHAT, b"[" * 10_000 + b"]" * 10_000, 400),
    ("POST", CHAT, _chat(tools=[{"a": json.loads("[" * 70 + "]" * 70)}]), 400),
    ("POST", CHAT, _chat(messages=[{"role": "user", "content": "w1 " * 3_000_000}]), 413),
    # truncated and non-UTF-8 bodies
    ("POST", CHAT, json.dumps(GOOD_CHAT).encode()[:-9], 400),
    ("POST", CHAT, json.dumps(GOOD_CHAT).encode().replace(b"w1", b"\xc3\x28"), 400),
    # logit_bias: not a map, a non-integer key, a value out of range, a token outside the vocabulary
    ("POST", CHAT, _chat(logit_bias=[1, 2]), 400),
    ("POST", CHAT, _chat(logit_bias={"abc": 1}), 400),
    ("POST", CHAT, _chat(logit_bias={"5": 1000}), 400),
    ("POST", CHAT, _chat(logit_bias={"99999": 1}), 400),
    # unknown model and route, wrong method
    ("POST", CHAT, _chat(model="gpt-4"), 404),
    ("POST", COMPLETIONS, _completion(model="gpt-4"), 404),
    ("GET", "/v1/nothing", None, 404),
    ("POST", "/v1/embeddings", {"model": "tiny", "input": "w1"}, 400),  # a text model computes no embeddings
    ("GET", CHAT, None, 405),
]


def make_app(engine: AsyncEngine, api_key: str | None = None, origins: tuple[str, ...] = ()):
    return OpenAIServer(engine, ServerConfig("tiny", api_key, origins)).app()


@pytest.fixture(scope="module")
def http(async_engine: AsyncEngine):
    with TestClient(make_app(async_engine)) as client:
        yield client


def send(http: TestClient, method: str, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.request(method, path, content=body, headers={"content-type": "application/json"})
    return http.request(method, path, json=body)


def assert_openai_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
    assert isinstance(error["type"], str)
    assert "param" in error and "code" in error
    return error


# ---- 200 bad requests -----------------------------------------------------------------------------
def test_200_bad_requests_get_openai_errors_and_server_stays_healthy(http: TestClient, async_engine):
    for method, path, body, status in itertools.islice(itertools.cycle(BAD_REQUESTS), 200):
        assert_openai_error(send(http, method, path, body), status)
    assert async_engine.num_pending == 0  # no rejected request leaked a queue slot
    # Refusals that only the engine's check can make name the field as the schema's do.
    outside = send(http, "POST", CHAT, _chat(logit_bias={"99999": 1}))
    assert assert_openai_error(outside, 400)["param"] == "logit_bias"
    assert assert_openai_error(send(http, "POST", COMPLETIONS, _completion(prompt="")), 400)["message"] == (
        "prompt: the prompt is empty"
    )
    assert http.get("/health").json() == {"status": "ok"}
    chat = http.post(CHAT, json=GOOD_CHAT)
    assert chat.status_code == 200 and chat.json()["usage"]["completion_tokens"] >= 1
    assert http.post(COMPLETIONS, json=GOOD_COMPLETION).status_code == 200


def test_null_means_the_default_as_openai_documents(http: TestClient):
    # The openai client sends null for a parameter an app passes as None ("number or null" in the docs).
    nulls = dict.fromkeys(["temperature", "top_p", "n", "presence_penalty", "frequency_penalty", "stream"])
    chat = http.post(CHAT, json={**GOOD_CHAT, **nulls, "logprobs": None, "parallel_tool_calls": None})
    assert chat.status_code == 200 and len(chat.json()["choices"]) == 1, chat.text
    completion = http.post(COMPLETIONS, json={**GOOD_COMPLETION, **nulls, "echo": None})
    assert completion.status_code == 200 and len(completion.json()["choices"]) == 1, completion.text
    response = http.post("/v1/responses", json={"input": "w1", "max_output_tokens": 4, "temperature": None})
    assert response.status_code == 200 and response.json()["temperature"] == 1.0, response.text


def test_malformed_message_parts_are_named(http: TestClient):
    calls = [{"id": "c1", "type": "function", "function": {"name": "", "arguments": "{}"}}]
    called = {"role": "assistant", "content": None, "tool_calls": calls}
    error = assert_openai_error(http.post(CHAT, json=_chat(messages=[W1, called, _tool_result("c1")])), 400)
    assert "messages.1.tool_calls.0.function.name" in error["message"]
    image = {"type": "image_url", "image_url": {"url": "data:,"}}
    user = {"role": "user", "content": [image]}
    error = assert_openai_error(http.post(CHAT, json=_chat(messages=[user])), 400)
    assert "'image_url' parts are not supported" in error["message"] and "messages.0" in error["message"]
    refusal = {"role": "assistant", "content": [{"type": "refusal", "refusal": "w2"}]}
    assert http.post(CHAT, json=_chat(messages=[W1, refusal, W1])).status_code == 200


def test_prompt_longer_than_context_names_both_numbers(http: TestClient):
    words = " ".join(f"w{i % 60}" for i in range(CONTEXT + 44))
    error = assert_openai_error(http.post(COMPLETIONS, json=_completion(prompt=words)), 400)
    assert str(CONTEXT + 44) in error["message"] and str(CONTEXT) in error["message"]
    # Prompt plus max_tokens beyond the context is no error: the answer stops at the edge with "length".
    body = http.post(COMPLETIONS, json=_completion(max_tokens=CONTEXT, ignore_eos=True)).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"] == CONTEXT


# ---- authentication -------------------------------------------------------------------------------
def test_api_key_required(async_engine: AsyncEngine):
    with TestClient(make_app(async_engine, api_key=API_KEY)) as client:
        assert assert_openai_error(client.get("/v1/models"), 401)["type"] == "authentication_error"
        assert_openai_error(client.post(CHAT, json=GOOD_CHAT, headers={"Authorization": "Bearer nope"}), 401)
        assert client.get("/health").status_code == 200  # probes need no key
        for scheme, status in (("bearer", 200), ("BEARER", 200), ("Basic", 401)):  # any case (RFC 9110)
            models = client.get("/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"})
            assert models.status_code == status, scheme
        keyed = openai.OpenAI(
            base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0
        )
        assert [m.id for m in keyed.models.list().data] == ["tiny"]
        r = keyed.chat.completions.create(model="tiny", messages=GOOD_CHAT["messages"], max_tokens=3)
        assert r.usage.completion_tokens >= 1
        unkeyed = openai.OpenAI(
            base_url="http://testserver/v1", api_key="wrong", http_client=client, max_retries=0
        )
        with pytest.raises(openai.AuthenticationError):
            unkeyed.models.list()


def test_cors_only_with_allowed_origins(async_engine: AsyncEngine):
    preflight = {"Origin": "http://example.com", "Access-Control-Request-Method": "POST"}
    with TestClient(make_app(async_engine)) as client:
        assert "access-control-allow-origin" not in client.options(CHAT, headers=preflight).headers
    with TestClient(make_app(async_engine, origins=("http://example.com",))) as client:
        allowed = client.options(CHAT, headers=preflight)
        assert allowed.headers["access-control-allow-origin"] == "http://example.com"


# ---- back-pressure --------------------------------------------------------------------------------
def test_queue_full_gets_429_with_retry_after(tiny_engine: Engine):
    # A second engine thread over a fresh Engine: max_pending belongs to the AsyncEngine.
    engine = AsyncEngine(
        Engine(tiny_engine.model, tiny_engine.tokenizer, CONTEXT, EngineConfig(num_blocks=64)), max_pending=1
    )
    prompt = tiny_engine.tokenizer.encode("w1 w2 w3")

    async def scenario() -> None:
        transport = httpx.ASGITransport(app=make_app(engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            held = engine.submit([(prompt, SamplingParams(max_tokens=200, ignore_eos=True))])
            refused = await client.post(CHAT, json=GOOD_CHAT)
            assert assert_openai_error(refused, 429)["type"] == "rate_limit_error"
            assert int(refused.headers["retry-after"]) >= 1
            held.close()
            assert (await client.post(CHAT, json=GOOD_CHAT)).status_code == 200
            # Nothing pending: a request with more choices than the limit runs (a 429 it could never pass).
            several = await client.post(CHAT, json={**GOOD_CHAT, "n": 3})
            assert several.status_code == 200 and len(several.json()["choices"]) == 3

    try:
        asyncio.run(scenario())
    finally:
        engine.close()


# ---- preemption on the real model -----------------------------------------------------------------
PREEMPT_PROMPTS = [
    "The history of the printing press",
    "A recipe for tomato soup",
    "The rules of chess are",
    "Volcanoes form when",
    "My favourite season is autumn because",
]
PREEMPT_TOKENS = 24
PREEMPT_BLOCKS = 4  # 64 tokens: each request (about 6 prompt + 24 new tokens = 2 blocks) fits alone


@pytest.mark.slow
def test_preemption_with_a_tiny_pool_still_finishes_every_request(smollm2_path: Path):
    server = LiveServer(smollm2_path, "--kv-memory", f"{kv_gib_for_blocks(PREEMPT_BLOCKS):.9f}")
    try:
        assert server.metrics()["mlx_infer_kv_blocks_total"] == PREEMPT_BLOCKS
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=180)
        kwargs = dict(
            model="smollm2", temperature=0, max_tokens=PREEMPT_TOKENS, extra_body={"ignore_eos": True}
        )
        solo = [client.completions.create(prompt=p, **kwargs) for p in PREEMPT_PROMPTS]
        # Together they need more blocks than the pool has: running requests get preempted and recomputed.
        needed = [-(-(r.usage.prompt_tokens + PREEMPT_TOKENS) // 16) for r in solo]
        assert max(needed) <= PREEMPT_BLOCKS < sum(needed) - max(needed)

        async def all_at_once() -> list[str]:
            async with openai.AsyncOpenAI(
                base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
            ) as aclient:
                results = await asyncio.gather(
                    *(aclient.completions.create(prompt=p, **kwargs) for p in PREEMPT_PROMPTS)
                )
            assert all(r.choices[0].finish_reason == "length" for r in results)
            return [r.choices[0].text for r in results]

        assert asyncio.run(all_at_once()) == [r.choices[0].text for r in solo]
        assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0
    finally:
        server.stop()


# ---- engine failure -------------------------------------------------------------------------------
def test_engine_failure_fails_the_requests_in_flight_and_server_keeps_serving(
    tiny_engine: Engine, monkeypatch
):
    engine = AsyncEngine(
        Engine(tiny_engine.model, tiny_engine.tokenizer, CONTEXT, EngineConfig(num_blocks=64))
    )
    try:
        with TestClient(make_app(engine)) as client:
            with monkeypatch.context() as patch:
                patch.setattr(engine.engine.runner, "execute", _raise_runtime_error)
                assert_openai_error(client.post(CHAT, json=GOOD_CHAT), 500)
                events = [
                    json.loads(line[6:])
                    for line in client.post(CHAT, json=_chat(stream=True)).text.splitlines()
                    if line.startswith("data: {")
                ]
                assert events[-1]["error"]["type"] == "server_error"
            assert client.post(CHAT, json=GOOD_CHAT).status_code == 200
            assert engine.num_pending == 0
    finally:
        engine.close()


def test_health_says_stalled_while_a_step_never_ends(tiny_engine: Engine, monkeypatch):
    """A step that does not end (a stopped peer rank, a hang) fails nothing, but /health stops saying ok
    until it ends."""
    from mlx_infer.server import app as server_app

    monkeypatch.setattr(server_app, "STALLED_STEP_S", 0.3)
    engine = fresh_engine(tiny_engine)
    release, stepping = threading.Event(), threading.Event()
    step = engine.engine.step

    def hung_step():
        stepping.set()
        release.wait(30)
        return step()

    monkeypatch.setattr(engine.engine, "step", hung_step)
    try:
        with TestClient(make_app(engine)) as client:
            assert client.get("/health").json() == {"status": "ok"}
            answer = threading.Thread(target=client.post, args=(CHAT,), kwargs={"json": GOOD_CHAT})
            answer.start()
            assert stepping.wait(30)
            time.sleep(0.5)
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "stalled", health.text
            release.set()
            answer.join(30)
            assert client.get("/health").json() == {"status": "ok"}
    finally:
        release.set()
        engine.close()


def _raise_runtime_error(*_: object) -> None:
    raise RuntimeError("simulated device failure")


def fresh_engine(tiny_engine: Engine) -> AsyncEngine:
    """An engine thread of its own over a fresh Engine (the test may break it)."""
    return AsyncEngine(Engine(tiny_engine.model, tiny_engine.tokenizer, CONTEXT, EngineConfig(num_blocks=64)))


# ---- validation at the edge -----------------------------------------------------------------------
def _post_within(app, path: str, body: object, seconds: float = 30.0) -> httpx.Response:
    """POST through the app in process, failing (not hanging) if no answer comes within ``seconds``."""

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            return await asyncio.wait_for(client.post(path, json=body), seconds)

    return asyncio.run(post())


def test_any_64_bit_seed_is_served_and_the_engine_survives(tiny_engine: Engine):
    # Seeds outside MLX's key range used to kill the engine thread: every later request then hung.
    engine = fresh_engine(tiny_engine)
    try:
        app = make_app(engine)
        texts = {}
        for seed in (-1, 2**64 - 1 - 2**63, 2**63 - 1, -(2**63), 0, 2**63, 2**70, -(2**70)):
            r = _post_within(app, CHAT, _chat(seed=seed, temperature=1.0, max_tokens=6))
            assert r.status_code == 200, r.text
            texts[seed] = r.json()["choices"][0]["message"]["content"]
        # Any integer, as llama-server: reduced mod 2**64, so -2**63 and 2**63 sample alike.
        assert texts[-(2**63)] == texts[2**63]
        assert _post_within(app, CHAT, GOOD_CHAT).status_code == 200
        assert engine.failure is None and engine.num_pending == 0
    finally:
        engine.close()


def test_deeply_nested_body_is_refused_before_parsing(http: TestClient):
    body = b'{"model": "tiny", "messages": ' + b"[" * 10_000 + b"]" * 10_000 + b"}"
    error = assert_openai_error(send(http, "POST", CHAT, body), 400)
    assert "10001 levels" in error["message"] and str(MAX_NESTING_DEPTH) in error["message"]
    # Brackets inside strings are text, not nesting.
    deep_text = _chat(messages=[{"role": "user", "content": "[" * 10_000}], max_tokens=1)
    assert http.post(CHAT, json=deep_text).status_code == 200


def test_body_over_the_limit_gets_413_with_or_without_content_length(async_engine: AsyncEngine):
    app = OpenAIServer(async_engine, ServerConfig("tiny", max_request_bytes=1000)).app()
    big = json.dumps(_chat(messages=[{"role": "user", "content": "w1 " * 400}])).encode()
    with TestClient(app) as client:
        error = assert_openai_error(client.post(CHAT, content=big), 413)
        assert "1000" in error["message"]
        # Sent in chunks without a Content-Length: counted as it arrives.
        assert_openai_error(client.post(CHAT, content=iter([big[:600], big[600:]])), 413)
        assert client.post(CHAT, json=GOOD_CHAT).status_code == 200


# ---- failures inside the engine -------------------------------------------------------------------
class _FailingDetokenizer:
    def add(self, token: int) -> str:
        raise ValueError("injected detokenizer failure")

    def flush(self) -> str:
        return ""


def test_a_request_failing_in_the_engine_fails_alone(tiny_engine: Engine, monkeypatch):
    engine = fresh_engine(tiny_engine)
    real = engine.engine.tokenizer.detokenizer
    try:
        with TestClient(make_app(engine)) as client:
            healthy = _chat(max_tokens=200, ignore_eos=True)
            results = {}
            thread = threading.Thread(target=lambda: results.update(ok=client.post(CHAT, json=healthy)))
            thread.start()
            while not engine.engine.requests:  # its detokenizer is made when the engine adds it
                time.sleep(0.001)
            monkeypatch.setattr(engine.engine.tokenizer, "detokenizer", _FailingDetokenizer)
            error = assert_openai_error(client.post(CHAT, json=GOOD_CHAT), 500)
            assert error["type"] == "server_error" and "ValueError" in error["message"]
            lines = client.post(CHAT, json=_chat(stream=True)).text.splitlines()
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            assert events[-1]["error"]["type"] == "server_error"
            assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream ends as streams do
            monkeypatch.setattr(engine.engine.tokenizer, "detokenizer", real)
            thread.join(timeout=60)
            assert results["ok"].status_code == 200
            assert results["ok"].json()["usage"]["completion_tokens"] == 200
            assert client.get("/health").json() == {"status": "ok"}
        assert engine.num_pending == 0 and engine.num_tracked == 0
        assert engine.engine.kv.pool.num_used == 0 and not engine.engine.requests
    finally:
        engine.close()


def test_stopped_engine_thread_answers_503_at_once(tiny_engine: Engine):
    engine = fresh_engine(tiny_engine)
    engine.engine.step = _raise_runtime_error  # escapes the engine's own isolation: the thread stops
    try:
        with TestClient(make_app(engine)) as client:
            error = assert_openai_error(client.post(CHAT, json=GOOD_CHAT), 503)
            assert "simulated device failure" in error["message"]
            health = client.get("/health")
            assert health.status_code == 503 and health.json()["status"] == "error"
            assert "simulated device failure" in health.json()["reason"]
            start = time.monotonic()
            assert_openai_error(client.post(CHAT, json=_chat(stream=True)), 503)
            assert_openai_error(client.post(COMPLETIONS, json=GOOD_COMPLETION), 503)
            assert time.monotonic() - start < 5
        assert engine.num_pending == 0
        with pytest.raises(EngineFailure):
            asyncio.run(_submit(engine))
    finally:
        engine.close()


async def _submit(engine: AsyncEngine) -> None:
    engine.submit([([4, 5, 6], SamplingParams(max_tokens=2))])


# ---- the serve process: loading, shutdown, engine failure (live servers on the tiny model) --------
SLOW_LOAD = """
import time
import mlx_infer.loading as loading
_load = loading.load
def slow_load(*args, **kwargs):
    time.sleep(4)
    return _load(*args, **kwargs)
loading.load = slow_load
"""
SLOW_STEPS = """
import time
from mlx_infer.engine.engine import Engine
_step = Engine.step
def slow_step(self):
    time.sleep(0.02)
    return _step(self)
Engine.step = slow_step
"""
# A load busy in MLX's native code (as reading and quantizing weights is) for its first seconds.
NATIVE_SLOW_LOAD = """
import time
import mlx.core as mx
import mlx_infer.loading as loading
_load = loading.load
def slow_load(*args, **kwargs):
    x, end = mx.random.normal((512, 512)), time.monotonic() + 8
    while time.monotonic() < end:
        mx.eval(x @ x)
    return _load(*args, **kwargs)
loading.load = slow_load
"""
BROKEN_ENGINE = """
from mlx_infer.engine.engine import Engine
def broken_step(self):
    raise SystemError("injected engine crash")
Engine.step = broken_step
"""


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serve") / "tiny"
    return write_hf_folder(folder, dict(tree_flatten(make_tiny_llama(0).parameters())), TINY_LLAMA_CONFIG)


def _stream_lines(base_url: str, body: dict, lines: list[str], started: threading.Event) -> None:
    with httpx.stream("POST", f"{base_url}{CHAT}", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            lines.append(line)
            started.set()


def test_health_is_503_while_the_model_loads(tiny_folder: Path):
    server = LiveServer(tiny_folder, name="tiny", preamble=SLOW_LOAD, wait_healthy=False)
    try:
        assert server.wait_for_health(503, 60).json() == {"status": "loading"}
        refused = httpx.post(f"{server.base_url}{CHAT}", json=GOOD_CHAT, timeout=10)
        assert assert_openai_error(refused, 503)["type"] == "server_error"
        # A browser opening the chat page gets a page that waits for the model, not JSON.
        page = httpx.get(f"{server.base_url}/", headers={"Accept": "text/html,*/*"}, timeout=10)
        assert page.status_code == 503 and page.headers["content-type"].startswith("text/html")
        assert "The model is loading" in page.text and 'http-equiv="refresh"' in page.text
        assert server.wait_for_health(200, 60).json() == {"status": "ok"}
        assert httpx.post(f"{server.base_url}{CHAT}", json=GOOD_CHAT, timeout=30).status_code == 200
    finally:
        server.stop()


def test_sigterm_lets_short_requests_finish_aborts_the_rest_and_exits_0(tiny_folder: Path):
    server = LiveServer(tiny_folder, "--shutdown-timeout", "1.5", name="tiny", preamble=SLOW_STEPS)
    try:
        streams = {}
        for name, tokens in (("short", 20), ("long", 240)):
            lines, started = [], threading.Event()
            body = _chat(max_tokens=tokens, ignore_eos=True)
            thread = threading.Thread(target=_stream_lines, args=(server.base_url, body, lines, started))
            thread.start()
            assert started.wait(30)
            streams[name] = (thread, lines)
        server.process.send_signal(signal.SIGTERM)
        start = time.monotonic()
        for thread, _ in streams.values():
            thread.join(timeout=30)
        assert server.process.wait(timeout=30) == 0
        # The long stream was cut at --shutdown-timeout, not run to its end (240 x 20 ms).
        assert time.monotonic() - start < 4.5
        short, long = streams["short"][1], streams["long"][1]
        assert short[-2:] == ["data: [DONE]", ""] or short[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in long if line.startswith("data: {")]
        assert events[-1]["error"]["message"] == "the server shut down before this request finished"
        assert 1 < len(events) < 240
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{server.base_url}/health", timeout=2)
    finally:
        server.stop()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_stop_while_the_model_loads_exits_0_without_an_abort(tiny_folder: Path, sig):
    server = LiveServer(tiny_folder, name="tiny", preamble=NATIVE_SLOW_LOAD, wait_healthy=False)
    try:
        server.wait_for_health(503, 60)
        time.sleep(1)  # well into the load
        server.process.send_signal(sig)
        assert server.process.wait(timeout=10) == 0, server.log()
        assert "terminate called" not in server.log() and "Traceback" not in server.log()
    finally:
        server.stop()


def test_a_second_ctrl_c_ends_every_request_with_its_error_and_exits_130(tiny_folder: Path):
    server = LiveServer(tiny_folder, "--shutdown-timeout", "60", name="tiny", preamble=SLOW_STEPS)
    try:
        lines, started = [], threading.Event()
        body = _chat(max_tokens=240, ignore_eos=True)
        stream = threading.Thread(target=_stream_lines, args=(server.base_url, body, lines, started))
        stream.start()
        assert started.wait(30)
        whole: list[httpx.Response] = []
        waiting = threading.Thread(
            target=lambda: whole.append(httpx.post(f"{server.base_url}{CHAT}", json=body, timeout=60))
        )
        waiting.start()
        # A client still sending its body: it must not hold the process either.
        stuck = socket.create_connection(("127.0.0.1", server.port))
        stuck.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: 100\r\n\r\n{\"model\":")  # fmt: skip
        time.sleep(0.5)
        server.process.send_signal(signal.SIGINT)
        time.sleep(0.5)
        start = time.monotonic()
        server.process.send_signal(signal.SIGINT)  # don't wait the 60 s
        assert server.process.wait(timeout=15) == 130
        assert time.monotonic() - start < 5
        stream.join(timeout=10)
        waiting.join(timeout=10)
        events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
        assert events[-1]["error"]["message"] == "the server shut down before this request finished"
        assert whole[0].status_code == 503 and "shut down" in whole[0].json()["error"]["message"]
        stuck.settimeout(5)
        assert stuck.recv(4096).startswith(b"HTTP/1.1 503")
        assert "Traceback" not in server.log(), server.log()
    finally:
        server.stop()


def test_serve_exits_7_soon_after_the_engine_stops(tiny_folder: Path):
    server = LiveServer(tiny_folder, name="tiny", preamble=BROKEN_ENGINE)
    try:
        error = assert_openai_error(httpx.post(f"{server.base_url}{CHAT}", json=GOOD_CHAT, timeout=10), 503)
        assert "injected engine crash" in error["message"]
        health = httpx.get(f"{server.base_url}/health", timeout=5)
        assert health.status_code == 503 and "injected engine crash" in health.json()["reason"]
        assert server.process.wait(timeout=20) == EngineFailure.exit_code
        assert "the engine has stopped" in server.log()
    finally:
        server.stop()


def test_a_loading_server_answers_each_client_in_its_own_shape():
    from mlx_infer.server.lifecycle import Supervisor

    with TestClient(Supervisor()) as loading:
        assert loading.get("/health").json() == {"status": "loading"}
        openai_shaped = loading.post(CHAT, json=GOOD_CHAT)
        assert assert_openai_error(openai_shaped, 503)["message"] == "the model is loading; retry shortly"
        for request in (
            loading.post("/v1/messages", json={}),
            loading.get("/v1/models", headers={"anthropic-version": "2023-06-01"}),
        ):
            assert request.status_code == 503 and request.headers["retry-after"] == "5"
            assert request.json()["type"] == "error" and "loading" in request.json()["error"]["message"]
