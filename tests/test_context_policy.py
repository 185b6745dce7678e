"""Context policies (whole turns dropped, never the system prompt or the last turn), answers that end
with "length" at the context's edge instead of being refused, and the server's three policies (tiny
random model, in process)."""

from __future__ import annotations

import pytest
from conftest import TINY_LLAMA_CONFIG, make_tiny_llama, write_hf_folder
from engine_helpers import CharTokenizer, tiny_llama
from mlx.utils import tree_flatten
from starlette.testclient import TestClient

from mlx_infer.context_policy import fit, request_policy, split_turns
from mlx_infer.engine.async_engine import AsyncEngine
from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.errors import ContextTooLong
from mlx_infer.loading import load
from mlx_infer.sampling import SamplingParams
from mlx_infer.server.app import OpenAIServer, ServerConfig

CHAT = "/v1/chat/completions"


def _message(role: str, n: int, words: int) -> dict:
    return {"role": role, "content": " ".join(f"w{n}" for _ in range(words)), "n": n}


def _render(messages: list[dict]) -> list[int]:
    """One token per word, the message's number as its id: which messages were sent can be read back."""
    return [m["n"] for m in messages for _ in m["content"].split()]


# system 5 | turn 1: 8 + 8 | turn 2: 14 + 14 | turn 3: 10 + 10 | last user 5  = 74 tokens
CONVERSATION = [
    _message("system", 1, 5),
    _message("user", 2, 8),
    _message("assistant", 3, 8),
    _message("user", 4, 14),
    _message("assistant", 5, 14),
    _message("user", 6, 10),
    _message("assistant", 7, 10),
    _message("user", 8, 5),
]


def _sent(ids: list[int]) -> list[int]:
    return sorted(set(ids))


def test_split_turns_pins_the_head_and_the_last_turn():
    messages = [
        {"role": "system", "content": "s"},
        {"role": "developer", "content": "d"},
        {"role": "assistant", "content": "greeting"},
        {"role": "user", "content": "u1"},
        {"role": "assistant", "content": "calls a tool"},
        {"role": "tool", "content": "result"},
        {"role": "user", "content": "u2"},
        {"role": "assistant", "content": "calls again"},
        {"role": "tool", "content": "result 2"},
    ]
    head, turns, last = split_turns(messages)
    assert [m["content"] for m in head] == ["s", "d"]
    assert [[m["content"] for m in t] for t in turns] == [["greeting"], ["u1", "calls a tool", "result"]]
    assert [m["content"] for m in last] == ["u2", "calls again", "result 2"]
    assert split_turns([{"role": "system", "content": "s"}]) == ([{"role": "system", "content": "s"}], [], [])


@pytest.mark.parametrize(
    "policy,budget,dropped,sent",
    [
        ("truncate-oldest", 74, 0, [1, 2, 3, 4, 5, 6, 7, 8]),
        ("truncate-oldest", 60, 1, [1, 4, 5, 6, 7, 8]),
        ("truncate-oldest", 57, 2, [1, 6, 7, 8]),
        ("truncate-middle", 60, 1, [1, 2, 3, 6, 7, 8]),
        ("truncate-middle", 45, 2, [1, 2, 3, 8]),
        ("truncate-middle", 25, 3, [1, 8]),
        ("truncate-oldest", 5, 3, [1, 8]),  # even the pinned messages are too long: all turns go
        ("error", 60, 0, [1, 2, 3, 4, 5, 6, 7, 8]),
    ],
)
def test_fit_drops_the_fewest_whole_turns(policy, budget, dropped, sent):
    fitted = fit(CONVERSATION, _render, budget, policy)
    assert fitted.dropped_turns == dropped
    assert _sent(fitted.prompt_ids) == sent


def test_fit_rejects_an_unknown_policy():
    with pytest.raises(ValueError, match="truncate-oldest"):
        fit(CONVERSATION, _render, 10, "drop-everything")


def test_request_policy_precedence():
    assert request_policy("error", None, None) == ("error", None)
    assert request_policy("error", "truncate-middle", None) == ("truncate-middle", None)
    assert request_policy("error", None, 40) == ("truncate-oldest", 40)
    assert request_policy("error", None, -1) == ("truncate-oldest", None)
    assert request_policy("truncate-oldest", "error", 40) == ("error", 40)


# ---- the engine: max_tokens is a cap, the context is the edge --------------------------------------
def _run(engine: Engine, prompt: list[int], params: SamplingParams) -> list:
    rid = engine.add_request(prompt, params)
    outputs = []
    while engine.has_unfinished():
        outputs += [o for o in engine.step() if o.request_id == rid]
    return outputs


@pytest.fixture(scope="module")
def char_model():
    return tiny_llama()


def test_answer_runs_to_the_end_of_the_context_and_finishes_with_length(char_model):
    config = EngineConfig(block_size=4, num_blocks=64, max_context=24)
    engine = Engine(char_model, CharTokenizer(), 256, config)
    outputs = _run(engine, list(range(1, 21)), SamplingParams(max_tokens=100, ignore_eos=True))
    assert sum(len(o.token_ids) for o in outputs) == 4
    assert outputs[-1].finish_reason == "length"
    check_block_accounting(engine)
    assert engine.kv.usage == 0.0


def test_answer_stops_at_the_end_of_a_small_kv_pool(char_model):
    engine = Engine(char_model, CharTokenizer(), 256, EngineConfig(block_size=4, num_blocks=8))
    outputs = _run(engine, list(range(1, 31)), SamplingParams(max_tokens=10, ignore_eos=True))
    assert sum(len(o.token_ids) for o in outputs) == 2 and outputs[-1].finish_reason == "length"


def test_a_prompt_longer_than_the_context_is_still_refused_naming_both_numbers(char_model):
    config = EngineConfig(block_size=4, num_blocks=64, max_context=24)
    engine = Engine(char_model, CharTokenizer(), 256, config)
    with pytest.raises(ContextTooLong, match="the prompt has 24 tokens but the context holds 24"):
        engine.add_request(list(range(1, 25)), SamplingParams(max_tokens=1))
    small = Engine(char_model, CharTokenizer(), 256, EngineConfig(block_size=4, num_blocks=8))
    with pytest.raises(ContextTooLong, match="the prompt has 40 tokens but the KV pool holds 32"):
        small.add_request([1] * 40, SamplingParams(max_tokens=1))


# ---- the server's policies ------------------------------------------------------------------------
SERVER_CONTEXT = 64


@pytest.fixture(scope="module")
def async_engine(tmp_path_factory):
    folder = tmp_path_factory.mktemp("policy") / "tiny"
    write_hf_folder(folder, dict(tree_flatten(make_tiny_llama(0).parameters())), TINY_LLAMA_CONFIG)
    loaded = load(str(folder))
    config = EngineConfig(num_blocks=16, max_context=SERVER_CONTEXT)
    engine = AsyncEngine(Engine(loaded.model, loaded.tokenizer, loaded.max_context, config))
    yield engine
    engine.close()


def _client(async_engine: AsyncEngine, default: str | None = None) -> TestClient:
    config = ServerConfig("tiny") if default is None else ServerConfig("tiny", context_overflow=default)
    return TestClient(OpenAIServer(async_engine, config).app())


def _chat_body(**fields) -> dict:
    messages = [{"role": m["role"], "content": m["content"]} for m in CONVERSATION]
    return {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **fields}


def test_server_default_policy_is_error_naming_both_numbers(async_engine):
    with _client(async_engine) as http:
        response = http.post(CHAT, json=_chat_body())
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "74" in message and str(SERVER_CONTEXT) in message
        # A conversation that fits is untouched.
        short = _chat_body(messages=_chat_body()["messages"][-1:])
        assert http.post(CHAT, json=short).json()["usage"]["prompt_tokens"] == 5


@pytest.mark.parametrize(
    "fields,prompt_tokens",
    [
        ({"context_overflow": "truncate-oldest"}, 58),  # turn 1 dropped: 74 - 16 fits 64 - 4
        ({"context_overflow": "truncate-middle"}, 46),  # turn 2 dropped, the first kept
        ({"truncate_prompt_tokens": 40}, 30),  # vLLM's field: turns 1 and 2 dropped
        ({"truncate_prompt_tokens": -1}, 58),
    ],
)
def test_server_request_policies_report_the_tokens_sent(async_engine, fields, prompt_tokens):
    with _client(async_engine) as http:
        response = http.post(CHAT, json=_chat_body(**fields))
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == prompt_tokens


def test_server_default_policy_from_the_flag_and_bad_fields(async_engine):
    with _client(async_engine, default="truncate-oldest") as http:
        assert http.post(CHAT, json=_chat_body()).json()["usage"]["prompt_tokens"] == 58
        assert http.post(CHAT, json=_chat_body(context_overflow="error")).status_code == 400
        for bad in ({"context_overflow": "rolling"}, {"truncate_prompt_tokens": 0}):
            error = http.post(CHAT, json=_chat_body(**bad)).json()["error"]
            assert error["param"] == next(iter(bad)), error


def test_server_answer_finishes_with_length_at_the_context_edge(async_engine):
    with _client(async_engine) as http:
        body = _chat_body(context_overflow="truncate-oldest", max_tokens=1000, ignore_eos=True)
        response = http.post(CHAT, json=body)
        assert response.status_code == 200, response.text
        usage = response.json()["usage"]
        # The reserve for the answer is at most half the context: turns 1 and 2 dropped (30 tokens).
        assert usage["prompt_tokens"] == 30
        assert usage["prompt_tokens"] + usage["completion_tokens"] == SERVER_CONTEXT
        assert response.json()["choices"][0]["finish_reason"] == "length"
