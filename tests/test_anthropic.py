"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``).

Error shapes, the stream's event sequence and authentication run in process on a tiny random model; what
the official ``anthropic`` client sees on the real SmolLM2 (greedy answers, streams equal to whole
answers, stop sequences, usage with the prefix cache, count_tokens) runs against a live server.
"""

from __future__ import annotations

import json
from pathlib import Path

import anthropic
import httpx
import httpx2
import pytest
from conftest import TINY_LLAMA_CONFIG
from pydantic import BaseModel
from server_helpers import LiveServer, wait_for_idle
from starlette.testclient import TestClient

from mlx_infer.engine.async_engine import AsyncEngine
from mlx_infer.engine.engine import Engine
from mlx_infer.loading.gguf_file import read_header
from mlx_infer.server.anthropic import MessagesRequest, chat_messages
from mlx_infer.server.app import OpenAIServer, ServerConfig
from mlx_infer.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

MESSAGES = "/v1/messages"
COUNT = "/v1/messages/count_tokens"
GOOD = {"model": "tiny", "max_tokens": 6, "messages": [{"role": "user", "content": "w1 w2 w3"}]}
API_KEY = "sekrit"


def _msg(**changes) -> dict:
    return {**GOOD, **changes}


def _user(content) -> dict:
    return _msg(messages=[{"role": "user", "content": content}])


def _answered(result: dict) -> dict:
    """A conversation whose assistant called the tool t1, then ``result`` from the user."""
    call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}
    return _msg(
        messages=[
            {"role": "user", "content": "w1"},
            {"role": "assistant", "content": [call]},
            {"role": "user", "content": [result]},
        ]
    )


NOT_TEXT = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
TOOL = {"name": "lookup", "description": "look up", "input_schema": {"type": "object", "properties": {}}}

# (path, body: a dict to send as JSON or raw bytes, expected status)
BAD_REQUESTS: list[tuple[str, object, int]] = [
    (MESSAGES, b"{", 400),
    (MESSAGES, b"[]", 400),
    (MESSAGES, b"", 400),
    (MESSAGES, {k: v for k, v in GOOD.items() if k != "max_tokens"}, 400),  # max_tokens is required
    (MESSAGES, {k: v for k, v in GOOD.items() if k != "messages"}, 400),
    (MESSAGES, _msg(max_tokens="many"), 400),
    (MESSAGES, _msg(max_tokens=0), 400),
    (MESSAGES, _msg(max_tokens=1.5), 400),
    (MESSAGES, _user("w1 " * 300), 400),  # longer than the context
    (MESSAGES, _msg(max_tokens=10**30), 400),
    (MESSAGES, json.dumps(GOOD).replace("w1", "\\ud83d").encode(), 400),  # half an emoji
    (MESSAGES, _msg(messages=[]), 400),
    (MESSAGES, _msg(messages="w1"), 400),
    (MESSAGES, _msg(messages=[{"role": "system", "content": "w1"}]), 400),
    (MESSAGES, _msg(messages=[{"content": "w1"}]), 400),
    (MESSAGES, _user(5), 400),
    (MESSAGES, _user([{"type": "video", "url": "x"}]), 400),  # unknown block type
    (MESSAGES, _user([{"text": "w1"}]), 400),  # a block without a type
    (MESSAGES, _user([NOT_TEXT]), 400),  # a known block type this server cannot read
    (MESSAGES, _user([{"type": "tool_use", "id": "t1", "name": "lookup", "input": {}}]), 400),
    (MESSAGES, _answered({"type": "tool_result", "tool_use_id": "t1", "content": [NOT_TEXT]}), 400),
    (MESSAGES, _answered({"type": "tool_result", "tool_use_id": "t2", "content": "w1"}), 400),  # no such call
    (MESSAGES, _user([{"type": "tool_result", "tool_use_id": "t1", "content": "w1"}]), 400),  # no call before
    (MESSAGES, _answered({"type": "text", "text": "w2"}), 400),  # the call unanswered, the talk goes on
    (MESSAGES, _msg(output_config={"format": {"type": "json_schema"}}), 400),  # no schema
    (MESSAGES, _msg(output_config={"format": {"type": "json_schema", "schema": {"type": "frob"}}}), 400),
    (MESSAGES, _msg(output_format={"type": "regex", "schema": {}}), 400),
    (
        MESSAGES,
        _msg(
            output_config={"format": {"type": "json_schema", "schema": {"type": "object"}}},
            messages=[{"role": "user", "content": "w1"}, {"role": "assistant", "content": "{"}],
        ),
        400,
    ),  # a prefill is no start of structured output
    (
        MESSAGES,
        _msg(
            messages=[
                {"role": "user", "content": "w1"},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "x", "input": {}}]},
            ]
        ),
        400,
    ),  # ends on a tool call with no result
    (MESSAGES, _msg(system=5), 400),
    (MESSAGES, _msg(system=[{"type": "image"}]), 400),
    (MESSAGES, _msg(temperature=1.5), 400),
    (MESSAGES, _msg(temperature="hot"), 400),
    (MESSAGES, json.dumps(GOOD).encode()[:-1] + b', "temperature": NaN}', 400),
    (MESSAGES, _msg(top_p=0), 400),
    (MESSAGES, _msg(top_k=-1), 400),
    (MESSAGES, _msg(stop_sequences="w1"), 400),
    (MESSAGES, _msg(stop_sequences=["w1"] * 17), 400),
    (MESSAGES, _msg(stop=["w1"]), 400),  # the OpenAI name, not ignored
    (MESSAGES, _msg(stream=[1]), 400),
    (MESSAGES, _msg(tools=[{"name": "lookup"}]), 400),  # no input_schema
    (MESSAGES, _msg(tools=[TOOL, TOOL]), 400),  # two tools of one name
    (MESSAGES, _msg(tools=[{**TOOL, "name": "look up!"}]), 400),
    (MESSAGES, _msg(tools=[{"type": "web_search_20250305", "name": "web_search"}]), 400),
    (MESSAGES, _msg(tools=[TOOL], tool_choice={"type": "tool"}), 400),  # no name
    (MESSAGES, _msg(tools=[TOOL], tool_choice={"type": "sometimes"}), 400),
    (MESSAGES, _msg(thinking={"type": "maybe"}), 400),
    (MESSAGES, _msg(messages=[{"role": "user", "content": "w1 " * 3_000_000}]), 413),
    (MESSAGES, b"[" * 10_000 + b"]" * 10_000, 400),
    (MESSAGES, _msg(model="claude-sonnet-4-5"), 404),
    (COUNT, {"model": "tiny"}, 400),
    (COUNT, {"model": "tiny", "messages": [{"role": "user", "content": [{"type": "video"}]}]}, 400),
    (COUNT, {"model": "claude-sonnet-4-5", "messages": GOOD["messages"]}, 404),
]
ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    401: "authentication_error",
}


# ---- in process, tiny random model ---------------------------------------------------------------
def send(http: TestClient, path: str, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"})
    return http.post(path, json=body)


def assert_anthropic_error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.text
    body = response.json()
    assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
    assert body["error"]["type"] == ERROR_TYPES[status], body
    message = body["error"]["message"]
    assert isinstance(message, str) and message and "\n" not in message
    return body["error"]


def sse(text: str) -> list[tuple[str, dict]]:
    """A text/event-stream body as (event name, data) pairs; the name must match the data's type."""
    events = []
    for chunk in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"]
        events.append((fields["event"], data))
    return events


def test_bad_requests_get_anthropic_errors_and_server_stays_healthy(http: TestClient, async_engine):
    for path, body, status in BAD_REQUESTS:
        error = assert_anthropic_error(send(http, path, body), status)
        if body is BAD_REQUESTS[3][1]:
            assert "max_tokens" in error["message"]
    assert_anthropic_error(http.get(MESSAGES), 405)
    assert async_engine.num_pending == 0  # no rejected request leaked a queue slot
    assert http.get("/health").json() == {"status": "ok"}
    ok = http.post(MESSAGES, json=GOOD)
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] >= 1


def test_stream_event_sequence_and_equality_with_the_whole_message(http: TestClient):
    body = _msg(temperature=0, max_tokens=8, ignore_eos=True)
    whole = http.post(MESSAGES, json=body).json()
    assert whole["type"] == "message" and whole["role"] == "assistant" and whole["id"].startswith("msg_")
    assert whole["stop_reason"] == "max_tokens" and whole["stop_sequence"] is None
    assert [b["type"] for b in whole["content"]] == ["text"] and whole["content"][0]["text"]

    response = http.post(MESSAGES, json={**body, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = sse(response.text)
    names = [name for name, _ in events]
    assert names[:3] == ["message_start", "ping", "content_block_start"]
    assert names[3:-3] == ["content_block_delta"] * (len(names) - 6)
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    start = events[0][1]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["model"] == "tiny"
    assert events[2][1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = [data["delta"] for _, data in events[3:-3]]
    assert all(d["type"] == "text_delta" for d in deltas)
    assert "".join(d["text"] for d in deltas) == whole["content"][0]["text"]
    final = events[-2][1]
    assert final["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert final["usage"]["output_tokens"] == whole["usage"]["output_tokens"] == 8
    # The prompt is counted once either way: computed now or read from the prefix cache.
    prompt = [u["input_tokens"] + u["cache_read_input_tokens"] for u in (final["usage"], whole["usage"])]
    assert prompt[0] == prompt[1] == http.post(COUNT, json=GOOD).json()["input_tokens"]


def test_an_answer_that_fills_the_context_says_so(http: TestClient):
    context = TINY_LLAMA_CONFIG["max_position_embeddings"]
    body = _user("w1 " * (context - 8)) | {"max_tokens": 1000, "ignore_eos": True}
    whole = http.post(MESSAGES, json=body).json()
    assert whole["stop_reason"] == "model_context_window_exceeded", whole
    assert 0 < whole["usage"]["output_tokens"] < 1000


def test_count_tokens_is_the_templated_prompt(http: TestClient, tiny_engine: Engine):
    body = {
        "model": "tiny",
        "system": [{"type": "text", "text": "w4 w5", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "w1 w2"}]},
            {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w3"},
        ],
    }
    expected = tiny_engine.tokenizer.encode_chat(
        [
            {"role": "system", "content": "w4 w5"},
            {"role": "user", "content": "w1 w2"},
            {"role": "assistant", "content": "w7"},
            {"role": "user", "content": "w3"},
        ]
    )
    assert http.post(COUNT, json=body).json() == {"input_tokens": len(expected)}


def test_turns_in_a_row_from_one_role_are_one_turn_and_a_failed_tool_says_so():
    call = {"type": "tool_use", "id": "t1", "name": "lookup", "input": {"q": "x"}}
    body = MessagesRequest.model_validate(
        _msg(
            system=[{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Answer in French."}],
            messages=[
                {"role": "user", "content": "w1"},
                {"role": "user", "content": [{"type": "text", "text": "w2"}, {"type": "text", "text": "w3"}]},
                {"role": "assistant", "content": [call]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "is_error": True,
                                              "content": [{"type": "text", "text": "boom"},
                                                          {"type": "text", "text": "at line 2"}]}]},
                {"role": "assistant", "content": "Hello."},
                {"role": "assistant", "content": " How"},
            ],
        )
    )
    function = {"name": "lookup", "arguments": '{"q": "x"}'}
    assert chat_messages(body) == [
        {"role": "system", "content": "Be brief.\nAnswer in French."},
        {"role": "user", "content": "w1\nw2\nw3"},
        {"role": "assistant", "content": "",
         "tool_calls": [{"id": "t1", "type": "function", "function": function}]},
        {"role": "tool", "tool_call_id": "t1", "content": "Error: boom\nat line 2"},
        {"role": "assistant", "content": "Hello. How"},  # one prefill, continued
    ]  # fmt: skip


def sdk_over(http: TestClient, api_key: str) -> anthropic.Anthropic:
    """The official client talking to an in-process app (it brings its own httpx fork, httpx2)."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        r = http.request(
            request.method, str(request.url), headers=dict(request.headers), content=request.read()
        )
        return httpx2.Response(r.status_code, headers=r.headers, content=r.content)

    transport = httpx2.Client(transport=httpx2.MockTransport(forward))
    return anthropic.Anthropic(
        base_url="http://testserver", api_key=api_key, http_client=transport, max_retries=0
    )


def test_api_key_by_x_api_key_or_bearer(async_engine: AsyncEngine):
    app = OpenAIServer(async_engine, ServerConfig("tiny", API_KEY)).app()
    with TestClient(app) as client:
        assert_anthropic_error(client.post(MESSAGES, json=GOOD), 401)
        assert_anthropic_error(client.post(MESSAGES, json=GOOD, headers={"x-api-key": "nope"}), 401)
        assert (
            client.post(MESSAGES, json=GOOD, headers={"Authorization": f"Bearer {API_KEY}"}).status_code
            == 200
        )
        # The SDK sends x-api-key; the OpenAI routes take it too.
        reply = sdk_over(client, API_KEY).messages.create(
            model="tiny", max_tokens=3, messages=GOOD["messages"]
        )
        assert reply.usage.output_tokens >= 1
        assert client.get("/v1/models", headers={"x-api-key": API_KEY}).status_code == 200
        with pytest.raises(anthropic.AuthenticationError):
            sdk_over(client, "nope").messages.create(model="tiny", max_tokens=3, messages=GOOD["messages"])


# ---- the official client on the real SmolLM2 ------------------------------------------------------
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = "The capital of France is Paris."  # greedy, as the chat route answers (test_server)
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    live = LiveServer(smollm2_path, "--kv-memory", "0.5")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_header(smollm2_path).metadata)


@pytest.mark.slow
def test_plain_and_streamed_messages_agree(client: anthropic.Anthropic, tok: Tokenizer):
    kwargs = dict(model="smollm2", max_tokens=32, messages=FRANCE, extra_body=GREEDY)
    whole = client.messages.create(**kwargs)
    assert [b.type for b in whole.content] == ["text"]
    assert whole.content[0].text == FRANCE_ANSWER
    assert whole.stop_reason == "end_turn" and whole.stop_sequence is None
    prompt_tokens = len(tok.encode_chat(FRANCE))
    assert whole.usage.input_tokens + whole.usage.cache_read_input_tokens == prompt_tokens
    with client.messages.stream(**kwargs) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == FRANCE_ANSWER
    assert final.content[0].text == FRANCE_ANSWER and final.stop_reason == "end_turn"
    assert final.usage.output_tokens == whole.usage.output_tokens
    # The same prompt again: most of it now comes from the prefix cache.
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == prompt_tokens
    assert final.usage.cache_read_input_tokens > 0


@pytest.mark.slow
@pytest.mark.parametrize("stream", [False, True])
def test_stop_sequences(client: anthropic.Anthropic, stream: bool):
    kwargs = dict(
        model="smollm2", max_tokens=32, messages=FRANCE, stop_sequences=["never", "is Par"], extra_body=GREEDY
    )
    if stream:
        with client.messages.stream(**kwargs) as s:
            reply = s.get_final_message()
    else:
        reply = client.messages.create(**kwargs)
    assert reply.content[0].text == FRANCE_ANSWER[: FRANCE_ANSWER.index("is Par")]
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence == "is Par"


@pytest.mark.slow
def test_max_tokens_system_and_prefill(client: anthropic.Anthropic, tok: Tokenizer, server: LiveServer):
    short = client.messages.create(model="smollm2", max_tokens=3, messages=FRANCE, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 3
    # A final assistant message is continued, not answered.
    prefilled = client.messages.create(
        model="smollm2",
        max_tokens=16,
        system="You are a helpful assistant.",
        messages=[*FRANCE, {"role": "assistant", "content": "The capital of France is"}],
        extra_body=GREEDY,
    )
    assert prefilled.content[0].text.startswith(" Paris")
    counted = client.messages.count_tokens(
        model="smollm2", system="You are a helpful assistant.", messages=FRANCE
    )
    assert counted.input_tokens == len(
        tok.encode_chat([{"role": "system", "content": "You are a helpful assistant."}, *FRANCE])
    )
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="smollm2", max_tokens=0, messages=FRANCE)
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0


@pytest.mark.slow
def test_structured_output_as_the_sdks_parse_asks_for_it(client: anthropic.Anthropic):
    class City(BaseModel):
        city: str
        population: int

    messages = [{"role": "user", "content": "Name a city and its population."}]
    kwargs = dict(model="smollm2", max_tokens=100, output_format=City, messages=messages, extra_body=GREEDY)
    parsed = client.messages.parse(**kwargs)  # output_config.format
    assert isinstance(parsed.parsed_output, City) and parsed.stop_reason == "end_turn"
    assert list(json.loads(parsed.content[0].text)) == ["city", "population"]
    beta = client.beta.messages.parse(**kwargs)
    assert beta.parsed_output == parsed.parsed_output
    with client.messages.stream(**kwargs) as s:
        assert s.get_final_message().parsed_output == parsed.parsed_output


@pytest.mark.slow
def test_models_and_request_ids_as_the_anthropic_client_reads_them(client: anthropic.Anthropic):
    page = client.models.list()
    assert [m.id for m in page.data] == ["smollm2"]
    assert (page.has_more, page.first_id, page.last_id) == (False, "smollm2", "smollm2")
    assert client.models.list(after_id="smollm2").data == []
    with pytest.raises(anthropic.BadRequestError):
        client.models.list(limit=0)
    info = client.models.retrieve("smollm2")
    assert (info.type, info.display_name, info.lifecycle, info.max_input_tokens) == (
        "model", "smollm2", "active", 8192
    )
    assert info.created_at.year >= 2026  # an RFC 3339 time the client parsed
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.models.retrieve("claude-sonnet-4-5")
    assert missing.value.body["error"]["type"] == "not_found_error"  # Anthropic's shape, not OpenAI's
    reply = client.messages.create(model="smollm2", max_tokens=1, messages=FRANCE)
    raw = client.messages.with_raw_response.create(
        model="smollm2", max_tokens=1, messages=FRANCE, extra_headers={"X-Request-Id": "mine-1"}
    )
    assert reply._request_id.startswith("req_") and raw.request_id == "mine-1"  # a proxy's own id kept


def test_models_pages_as_anthropics_list():
    from starlette.requests import Request

    from mlx_infer.server.app import _anthropic_page

    cards = [{"id": name, "created": 0} for name in "abcde"]

    def page(query: str) -> tuple[list[str], bool, str | None, str | None]:
        got = _anthropic_page(cards, Request({"type": "http", "query_string": query.encode(), "headers": []}))
        return [m["id"] for m in got["data"]], got["has_more"], got["first_id"], got["last_id"]

    assert page("") == (list("abcde"), False, "a", "e")
    assert page("limit=2") == (["a", "b"], True, "a", "b")
    assert page("limit=2&after_id=b") == (["c", "d"], True, "c", "d")
    assert page("limit=2&after_id=d") == (["e"], False, "e", "e")
    assert page("limit=2&before_id=d") == (["b", "c"], True, "b", "c")
    assert page("limit=2&before_id=b") == (["a"], False, "a", "a")
