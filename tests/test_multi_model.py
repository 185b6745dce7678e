"""Several models from one server (issue 21, item 3): ``serve -m A -m B`` and ``--models-dir``.

The registry's policy on fakes (one load for two first requests, least-recently-used eviction of idle
models only, the memory budget, a model too large, an unknown name), then real servers with the
openai client: SmolLM2 and a tiny random Llama answering concurrent streams that do not wait for each
other, eviction with ``--max-loaded-models 1``, 404 ``model_not_found`` naming the loaded models.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai
import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from mlx.utils import tree_flatten
from server_helpers import LiveServer

from mlx_infer.errors import InvalidCheckpoint, ModelNotFound, ModelTooLarge, ServiceUnavailable
from mlx_infer.server.model_registry import ModelRegistry, ModelSpec
from mlx_infer.server.served_model import declared_context


# ---- the registry, on fake models ---------------------------------------------------------------------
@dataclass
class FakeEngine:
    failure: str | None = None
    num_pending: int = 0
    closed_reason: str | None = None

    def close_admission(self, reason: str) -> None:
        self.closed_reason = reason

    def abort_all(self, error: Exception) -> None:
        pass

    stalled: float = 0.0

    def stalled_for(self) -> float:
        return self.stalled


@dataclass
class FakeModel:
    name: str
    footprint: int
    app: object = None
    engine: FakeEngine = field(default_factory=FakeEngine)
    context_length: int = 256
    closed: bool = False

    def close(self) -> None:
        self.closed = True


class Loader:
    """Loads fake models of the sizes given, counting loads; ``gate`` holds a load until set."""

    def __init__(self, sizes: dict[str, int]):
        self.sizes = sizes
        self.loads: list[str] = []
        self.models: dict[str, FakeModel] = {}
        self.gate = threading.Event()
        self.gate.set()
        self.broken: set[str] = set()  # models whose load fails

    def specs(self) -> list[ModelSpec]:
        return [ModelSpec(name, f"/models/{name}", size) for name, size in self.sizes.items()]

    def load(self, spec: ModelSpec) -> FakeModel:
        self.gate.wait(10)
        if spec.name in self.broken:
            raise InvalidCheckpoint(f"{spec.path}: truncated")
        self.loads.append(spec.name)
        self.models[spec.name] = FakeModel(spec.name, spec.size)
        return self.models[spec.name]

    def registry(self, max_loaded: int = 3, budget: int = 1000, wait: float = 5.0) -> ModelRegistry:
        return ModelRegistry(self.specs(), self.load, lambda s: s.size, max_loaded, budget, wait)


def run(coroutine):
    return asyncio.run(coroutine)


def test_two_first_requests_load_a_model_once():
    loader = Loader({"a": 10})
    registry = loader.registry()

    async def main():
        loader.gate.clear()
        first = asyncio.create_task(registry.acquire("a"))
        second = asyncio.create_task(registry.acquire("a"))
        await asyncio.sleep(0.05)
        assert registry.state("a") == "loading"
        loader.gate.set()
        return await first, await second

    one, two = run(main())
    assert one is two and loader.loads == ["a"]
    assert registry.state("a") == "loaded"
    registry.close()


def test_the_least_recently_used_idle_model_is_unloaded():
    loader = Loader({"a": 10, "b": 10, "c": 10})
    registry = loader.registry(max_loaded=2)

    async def use(name: str) -> None:
        await registry.acquire(name)
        registry.release(name)

    async def main():
        for name in ["a", "b", "a", "c"]:  # "a" used again: "b" is the least recently used
            await use(name)

    run(main())
    assert list(registry.loaded()) == ["a", "c"]
    assert loader.models["b"].closed and not loader.models["a"].closed
    assert (registry.stats.loads, registry.stats.unloads) == (3, 1)
    registry.close()
    assert loader.models["a"].closed and loader.models["c"].closed


def test_a_failed_load_is_logged_and_leaves_the_model_loadable(caplog):
    loader = Loader({"a": 10})
    registry = loader.registry()
    loader.broken.add("a")
    with caplog.at_level(logging.ERROR, logger="mlx_infer"), pytest.raises(InvalidCheckpoint):
        run(registry.acquire("a"))
    assert "could not load 'a': /models/a: truncated" in caplog.text
    assert registry.state("a") == "not-loaded"
    loader.broken.clear()  # the file fixed: the next request loads it
    run(registry.acquire("a"))
    assert registry.state("a") == "loaded"
    registry.close()


def test_a_loaded_models_stalled_step_is_reported():
    loader = Loader({"a": 10, "b": 10})
    registry = loader.registry()
    run(registry.acquire("a"))
    run(registry.acquire("b"))
    assert registry.stalled(120) is None
    loader.models["b"].engine.stalled = 500.0
    assert registry.stalled(120) == "b: its engine's current step has run for 500 s"
    registry.close()


def test_a_busy_model_is_never_unloaded_the_load_waits_then_fails_clearly():
    loader = Loader({"a": 10, "b": 10})
    registry = loader.registry(max_loaded=1, wait=0.3)

    async def main():
        await registry.acquire("a")  # held: a stream in progress
        with pytest.raises(ServiceUnavailable, match="every loaded model \\('a'\\) is answering"):
            await registry.acquire("b")
        assert not loader.models["a"].closed
        # Released while b's load waits: a goes, b comes.
        waiting = asyncio.create_task(registry.acquire("b"))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        registry.release("a")
        await waiting

    run(main())
    assert loader.models["a"].closed and list(registry.loaded()) == ["b"]
    registry.close()


def test_requests_queued_for_one_load_share_its_deadline():
    # Three requests for b while a is busy: each gets its 503 when the wait ends, not one wait after the
    # other (the second began waiting only when the first gave up).
    loader = Loader({"a": 10, "b": 10})
    registry = loader.registry(max_loaded=1, wait=0.3)

    async def main():
        await registry.acquire("a")  # held: a stream in progress
        start = time.monotonic()
        waits = [asyncio.create_task(registry.acquire("b")) for _ in range(3)]
        results = await asyncio.gather(*waits, return_exceptions=True)
        return time.monotonic() - start, results

    elapsed, results = run(main())
    assert all(isinstance(r, ServiceUnavailable) for r in results)
    assert elapsed < 0.6, elapsed
    registry.close()


def test_memory_budget_evicts_and_a_model_that_cannot_fit_is_refused():
    loader = Loader({"a": 600, "b": 500, "huge": 1001})
    registry = loader.registry(max_loaded=3, budget=1000)

    async def main():
        await registry.acquire("a")
        registry.release("a")
        await registry.acquire("b")  # 600 + 500 > 1000: a goes first
        assert list(registry.loaded()) == ["b"] and loader.models["a"].closed
        assert registry.used_bytes() == 500
        with pytest.raises(ModelTooLarge, match="1001 bytes.*1000 bytes"):
            await registry.acquire("huge")
        assert list(registry.loaded()) == ["b"]  # nothing unloaded for a model that cannot fit

    run(main())
    registry.close()


def test_unknown_model_names_the_available_and_loaded_ones():
    loader = Loader({"a": 1, "b": 1})
    registry = loader.registry()

    async def main():
        await registry.acquire("b")
        with pytest.raises(ModelNotFound, match="serves 'a', 'b' \\(loaded: 'b'\\)"):
            await registry.acquire("gpt-4")

    run(main())
    registry.close()


# ---- real servers -------------------------------------------------------------------------------------
SMOLLM2 = "SmolLM2-135M-Instruct.Q4_1"


def tiny_folder(root: Path, name: str, seed: int) -> Path:
    weights = dict(tree_flatten(make_tiny_llama(seed).parameters()))
    return write_hf_folder(root / name, weights, TINY_LLAMA_CONFIG)


@pytest.fixture(scope="module")
def two_models(smollm2_path, tmp_path_factory):
    tiny = tiny_folder(tmp_path_factory.mktemp("models"), "tiny", 0)
    server = LiveServer([smollm2_path, tiny], "--kv-memory", "0.2", name=None)
    yield server
    server.stop()


def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def test_models_are_listed_and_loaded_on_first_request(two_models):
    listed = {m.id: m.model_dump() for m in client(two_models).models.list()}
    assert listed.keys() == {SMOLLM2, "tiny"}
    assert listed["tiny"]["context_length"] == 256 and listed[SMOLLM2]["context_length"] == 8192
    assert listed[SMOLLM2]["quantization"] == "Q4_1"
    assert client(two_models).models.retrieve("tiny").model_dump() == listed["tiny"]
    # ignore_eos: the tiny model samples its 64 tokens at random, EOS among them (~3 runs in 64 ended early)
    answer = client(two_models).completions.create(
        model="tiny", prompt="w1 w2", max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert answer.model == "tiny" and answer.usage.completion_tokens == 4
    states = httpx.get(two_models.base_url + "/health").json()["models"]
    assert states["tiny"] == "loaded"


def stream_times(server: LiveServer, model: str, prompt: str, max_tokens: int) -> tuple[list[float], str]:
    """Arrival time of each streamed chunk that carries text, and the text."""
    times, text = [], []
    stream = client(server).completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.monotonic())
            text.append(chunk.choices[0].text)
    return times, "".join(text)


def test_streams_to_two_models_do_not_wait_for_each_other(two_models):
    results: dict[str, tuple[list[float], str]] = {}
    long = threading.Thread(
        target=lambda: results.__setitem__("smol", stream_times(two_models, SMOLLM2, "Once upon a time", 300))
    )
    long.start()
    deadline = time.monotonic() + 120
    running = f'mlx_infer_requests_running{{model="{SMOLLM2}"}}'
    while two_models.metrics().get(running, 0) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    time.sleep(0.5)  # SmolLM2 is mid-stream now
    results["tiny"] = stream_times(two_models, "tiny", "w3 w4 w5", 150)
    long.join(180)
    smol_times, smol_text = results["smol"]
    tiny_times, tiny_text = results["tiny"]
    assert len(tiny_times) > 100 and len(smol_times) > 250
    # The tiny model's stream ran within SmolLM2's, and SmolLM2 kept streaming meanwhile.
    assert smol_times[0] < tiny_times[0] and tiny_times[-1] < smol_times[-1]
    assert any(tiny_times[0] < t < tiny_times[-1] for t in smol_times)
    # Each answer is what the model says alone.
    assert stream_times(two_models, "tiny", "w3 w4 w5", 150)[1] == tiny_text
    assert stream_times(two_models, SMOLLM2, "Once upon a time", 300)[1] == smol_text


def test_unknown_model_is_404_naming_the_loaded_ones(two_models):
    client(two_models).completions.create(model="tiny", prompt="w1", max_tokens=1)
    with pytest.raises(openai.NotFoundError) as caught:
        client(two_models).chat.completions.create(
            model="gpt-4", messages=[{"role": "user", "content": "hi"}]
        )
    error = caught.value.body
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert f"serves '{SMOLLM2}', 'tiny'" in error["message"] and "loaded: " in error["message"]
    assert "'tiny'" in error["message"].split("loaded: ")[1]
    # Anthropic's route answers in Anthropic's shape.
    response = httpx.post(
        two_models.base_url + "/v1/messages",
        json={"model": "claude", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]},
    )
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "not_found_error"
    # Several models and none named: a 400 that lists them.
    response = httpx.post(two_models.base_url + "/v1/completions", json={"prompt": "w1"})
    assert response.status_code == 400 and "'tiny'" in response.json()["error"]["message"]


def test_a_gguf_repos_snapshot_declares_its_files_context(smollm2_path, tmp_path):
    # `-m ORG/NAME` of a GGUF repo resolves to its snapshot folder: /v1/models of the model not loaded
    # reads the context from the one GGUF file in it (it said null).
    snapshot = tmp_path / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "SmolLM2.Q4_1.gguf").symlink_to(smollm2_path)
    assert declared_context(str(snapshot)) == declared_context(str(smollm2_path)) == 8192


def test_models_dir_eviction_with_one_loaded_and_a_model_too_large(smollm2_path, tmp_path):
    root = tmp_path / "models"
    tiny_folder(root, "tiny-a", 1)
    tiny_folder(root / "more", "tiny-b", 2)
    (root / "smollm2.gguf").symlink_to(smollm2_path)
    (root / "cut.gguf").write_bytes(b"GGUF\x03\x00")  # a download cut short: left out, not fatal
    server = LiveServer(
        None,
        *("--models-dir", str(root), "--max-loaded-models", "1", "--kv-memory", "0.01"),
        *("--models-memory", "0.05"),
        name=None,
    )
    try:
        c = client(server)
        assert {m.id for m in c.models.list()} == {"tiny-a", "more/tiny-b", "smollm2"}
        a = c.completions.create(model="tiny-a", prompt="w1 w2", max_tokens=6, temperature=0)
        c.completions.create(model="more/tiny-b", prompt="w1 w2", max_tokens=6, temperature=0)
        health = httpx.get(server.base_url + "/health").json()
        assert health["models"] == {"tiny-a": "not-loaded", "more/tiny-b": "loaded", "smollm2": "not-loaded"}
        metrics = server.metrics()
        assert metrics["mlx_infer_model_unloads_total"] == 1 and metrics["mlx_infer_models_loaded"] == 1
        again = c.completions.create(model="tiny-a", prompt="w1 w2", max_tokens=6, temperature=0)
        assert again.choices[0].text == a.choices[0].text  # reloaded, same weights, same answer
        # SmolLM2's weights alone exceed 0.05 GiB: a 400 giving both in bytes; tiny-a stays.
        with pytest.raises(openai.BadRequestError, match="needs about .* bytes.*budget .* bytes"):
            c.completions.create(model="smollm2", prompt="hi", max_tokens=1)
        assert httpx.get(server.base_url + "/health").json()["models"]["tiny-a"] == "loaded"
    finally:
        server.stop()


def test_a_503_that_says_when_to_retry_carries_retry_after():
    """The registry's "retry shortly" 503 (every loaded model busy) tells clients when, on both API shapes."""
    from mlx_infer.errors import ServiceUnavailable
    from mlx_infer.server.errors import anthropic_from_exception, from_exception

    busy = ServiceUnavailable("every loaded model is answering requests; retry shortly", retry_after=5)
    assert from_exception(busy).status_code == 503 and from_exception(busy).headers["Retry-After"] == "5"
    assert anthropic_from_exception(busy).headers["Retry-After"] == "5"
    assert "Retry-After" not in from_exception(ServiceUnavailable("shut down")).headers
