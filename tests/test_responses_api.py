"""OpenAI's Responses API (``/v1/responses``, stateless).

Error shapes and the stream's typed events run in process on a tiny random model; the official ``openai``
client's ``responses.create`` / ``responses.stream`` on the real SmolLM2 runs against a live server.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import LiveServer, wait_for_idle
from starlette.testclient import TestClient

from mlx_infer.loading.gguf_file import read_header
from mlx_infer.server.openai_responses import ResponsesRequest
from mlx_infer.tokenizer import Tokenizer
from mlx_infer.tool_calls import ToolChoice

pytestmark = pytest.mark.timeout(300)

RESPONSES = "/v1/responses"
GOOD = {"model": "tiny", "input": "w1 w2 w3", "max_output_tokens": 6}


def _resp(**changes) -> dict:
    return {**GOOD, **changes}


# (body: a dict to send as JSON or raw bytes, expected status)
BAD_REQUESTS: list[tuple[object, int]] = [
    (b"{", 400),
    (b"[]", 400),
    (json.dumps(GOOD).replace("w1", "\\ud83d").encode(), 400),  # half an emoji
    ({"model": "tiny"}, 400),
    (_resp(input=5), 400),
    (_resp(input=[]), 400),
    (_resp(input=[{"type": "video", "url": "x"}]), 400),  # unknown item type
    (_resp(input=[{"role": "robot", "content": "w1"}]), 400),
    (_resp(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]), 400),
    (_resp(input=[{"role": "user", "content": [{"type": "hologram"}]}]), 400),
    (_resp(input=[{"type": "function_call", "name": "f"}]), 400),  # no call_id, no arguments
    (_resp(input=[{"type": "function_call_output", "call_id": "c"}]), 400),  # no output
    (
        _resp(
            input=[
                {"role": "user", "content": "w1"},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ]
        ),
        400,
    ),  # answers no function_call
    (_resp(instructions=5), 400),
    (_resp(max_output_tokens=0), 400),
    (_resp(max_output_tokens="many"), 400),
    (_resp(input="w1 " * 300), 400),  # longer than the context
    (_resp(temperature=3), 400),
    (_resp(top_p=0), 400),
    (json.dumps(GOOD).encode()[:-1] + b', "temperature": NaN}', 400),
    (_resp(stream="yes please"), 400),
    (_resp(tools=[{"type": "web_search"}]), 400),
    (_resp(tools=[{"type": "function"}]), 400),  # no name
    (_resp(tool_choice="sometimes"), 400),
    (_resp(text={"format": {"type": "xml"}}), 400),
    (_resp(text={"format": {"type": "json_schema", "schema": {}}}), 400),  # no name
    (_resp(text={"format": {"type": "json_schema", "name": "has space!", "schema": {}}}), 400),
    (_resp(store=True), 400),
    (_resp(background=True), 400),  # needs store
    (_resp(truncation="sometimes"), 400),
    (_resp(top_logprobs=21), 400),
    (_resp(reasoning={"effort": "extreme"}), 400),
    (_resp(previous_response_id="resp_123"), 400),
    (_resp(conversation="conv_123"), 400),
    (_resp(prompt={"id": "pmpt_123"}), 400),
    ({"model": "tiny", "prompt": {"id": "pmpt_123"}}, 400),
    (_resp(max_tokens=2), 400),  # the chat API's names, not ignored
    (_resp(max_completion_tokens=2), 400),
    (_resp(messages=[{"role": "user", "content": "w1"}]), 400),
    (_resp(response_format={"type": "json_object"}), 400),
    (_resp(n=2), 400),
    (_resp(stop=["w1"] * 17), 400),
    (
        _resp(
            input=[
                {"role": "user", "content": "w1"},
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"},
            ]
        ),
        400,
    ),  # a function_call with no output
    (_resp(tools=[{"type": "function", "name": "f"}] * 2), 400),  # two tools of one name
    (_resp(input="w1 " * 3_000_000), 413),
    (b"[" * 10_000 + b"]" * 10_000, 400),
    (_resp(model="gpt-5"), 404),
]


# ---- in process, tiny random model ---------------------------------------------------------------
def send(http: TestClient, body: object) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(RESPONSES, content=body, headers={"content-type": "application/json"})
    return http.post(RESPONSES, json=body)


def sse(text: str) -> list[dict]:
    """A text/event-stream body as its data objects; each event name must match the data's type."""
    events = []
    for chunk in text.strip().split("\n\n"):
        fields = dict(line.split(": ", 1) for line in chunk.splitlines())
        data = json.loads(fields["data"])
        assert data["type"] == fields["event"]
        events.append(data)
    return events


def test_bad_requests_get_openai_errors_and_server_stays_healthy(http: TestClient, async_engine):
    for body, status in BAD_REQUESTS:
        response = send(http, body)
        assert response.status_code == status, (body if len(str(body)) < 300 else "(long)", response.text)
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"]
        assert {"type", "param", "code"} <= set(error)
    stored = send(http, _resp(store=True)).json()["error"]
    assert stored["param"] == "store" and "store=false" in stored["message"]
    chat_name = send(http, _resp(max_tokens=2)).json()["error"]
    assert chat_name["param"] == "max_tokens" and "max_output_tokens" in chat_name["message"]
    template = send(http, {"model": "tiny", "prompt": {"id": "pmpt_123"}}).json()["error"]
    assert template["param"] == "prompt" and "prompt templates" in template["message"]
    assert send(http, {"model": "tiny"}).json()["error"]["param"] == "input"
    allowed = _resp(tool_choice={"type": "allowed_tools", "mode": "auto", "tools": []})
    assert send(http, allowed).json()["error"]["param"] == "tool_choice.type"  # no pydantic class name
    # A union's error is its most specific member's: the item's missing field, not "a valid string".
    missing = send(http, _resp(input=[{"role": "user", "content": "w1"}, {"type": "function_call_output"}]))
    assert missing.json()["error"]["param"] == "input.1.function_call_output.call_id"
    unknown = send(http, _resp(input=[{"type": "item_reference", "id": "msg_1"}])).json()["error"]
    assert unknown["message"].startswith("input.0: an input item is a message, function_call")
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}
    assert send(http, _resp(input=[image])).json()["error"]["param"] == "input.0"
    assert async_engine.num_pending == 0
    assert http.get("/health").json() == {"status": "ok"}
    assert send(http, GOOD).status_code == 200


def test_stream_typed_events_and_equality_with_the_whole_response(http: TestClient):
    body = _resp(temperature=0, max_output_tokens=8, ignore_eos=True, instructions="w9")
    whole = http.post(RESPONSES, json=body).json()
    assert whole["object"] == "response" and whole["id"].startswith("resp_")
    assert whole["status"] == "incomplete" and whole["incomplete_details"] == {"reason": "max_output_tokens"}
    [message] = whole["output"]
    # Cut off by max_output_tokens: the message item is incomplete too, as OpenAI marks it.
    assert (
        message["type"] == "message" and message["role"] == "assistant" and message["status"] == "incomplete"
    )
    [part] = message["content"]
    assert part["type"] == "output_text" and part["text"]
    assert whole["usage"]["output_tokens"] == 8
    assert whole["usage"]["total_tokens"] == whole["usage"]["input_tokens"] + 8

    events = sse(http.post(RESPONSES, json={**body, "stream": True}).text)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    types = [e["type"] for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[4:-4] == ["response.output_text.delta"] * (len(types) - 8)
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2])
    text = "".join(e["delta"] for e in events[4:-4])
    assert text == events[-4]["text"] == part["text"]
    final = events[-1]["response"]
    assert events[-2]["item"]["status"] == "incomplete" == final["output"][0]["status"]
    assert final["output"][0]["content"][0]["text"] == text
    assert final["usage"]["output_tokens"] == 8
    assert final["usage"]["input_tokens"] == whole["usage"]["input_tokens"]


def test_input_items_become_the_chat_template_messages(http: TestClient):
    """Messages, a function call and its output in the prompt exactly as the chat route templates them."""
    items = [
        {"role": "developer", "content": "w4"},
        {"role": "user", "content": [{"type": "input_text", "text": w} for w in ("w1", "w2")]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {
            "type": "function_call_output",
            "call_id": "c1",
            "output": [{"type": "input_text", "text": w} for w in ("w5", "w6")],
        },
    ]
    reply = http.post(RESPONSES, json=_resp(input=items, instructions="w9")).json()
    chat = {
        "model": "tiny",
        "max_tokens": 1,
        "messages": [
            {"role": "system", "content": "w9"},
            {"role": "system", "content": "w4"},
            {"role": "user", "content": [{"type": "text", "text": "w1"}, {"type": "text", "text": "w2"}]},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "w5\nw6"},
        ],
    }
    expected = http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"]
    assert reply["usage"]["input_tokens"] == expected
    # Text parts join a line each (as vLLM's), on both routes.
    chat["messages"][2]["content"] = "w1\nw2"
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] == expected
    chat["messages"][2]["content"] = "w1w2"
    assert http.post("/v1/chat/completions", json=chat).json()["usage"]["prompt_tokens"] != expected


def test_truncation_auto_drops_the_oldest_turns_and_fields_are_echoed(http: TestClient):
    turns = []
    for _ in range(12):  # ~30 tokens a turn: 360 in all, past the tiny model's 256-token context
        turns += [{"role": "user", "content": "w1 " * 12}, {"role": "assistant", "content": "w2 " * 12}]
    turns.append({"role": "user", "content": "w3"})
    assert send(http, _resp(input=turns)).status_code == 400  # disabled: the server's policy, an error
    echoed = {"user": "u1", "prompt_cache_key": "k1", "safety_identifier": "s1", "service_tier": "auto",
              "reasoning": {"effort": "low"}, "text": {"verbosity": "low"}}  # fmt: skip
    reply = send(http, _resp(input=turns, truncation="auto", **echoed))
    assert reply.status_code == 200, reply.text
    body = reply.json()
    assert body["truncation"] == "auto" and 0 < body["usage"]["input_tokens"] < 256
    assert (body["user"], body["prompt_cache_key"], body["safety_identifier"]) == ("u1", "k1", "s1")
    assert body["service_tier"] == "default" and body["reasoning"] == {"effort": "low", "summary": None}
    assert body["text"] == {"format": {"type": "text"}, "verbosity": "low"}
    assert body["status"] == "incomplete" and body["completed_at"] is None  # cut by max_output_tokens
    # The chat route's form of a named tool choice is the same choice.
    chat_form = {"type": "function", "function": {"name": "f"}}
    assert ResponsesRequest.model_validate(_resp(tool_choice=chat_form)).openai_tool_choice() == ToolChoice(
        "required", "f"
    )


# ---- the official client on the real SmolLM2 ------------------------------------------------------
FRANCE = "What is the capital of France?"
FRANCE_ANSWER = "The capital of France is Paris."  # greedy, as the chat route answers (test_server)


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    live = LiveServer(smollm2_path, "--kv-memory", "0.5")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_header(smollm2_path).metadata)


@pytest.mark.slow
def test_responses_create_plain_and_streamed(client: openai.OpenAI, tok: Tokenizer, server: LiveServer):
    kwargs = dict(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=32)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and whole.output_text == FRANCE_ANSWER
    assert whole.usage.input_tokens == len(tok.encode_chat([{"role": "user", "content": FRANCE}]))
    with client.responses.stream(**kwargs) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == FRANCE_ANSWER == final.output_text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.input_tokens_details.cached_tokens > 0  # the same prompt again
    # stop, as the chat route takes it (an extension: OpenAI's Responses API has no stop strings)
    stopped = client.responses.create(**kwargs, extra_body={"stop": ["never", "is Par"]})
    assert stopped.status == "completed"
    assert stopped.output_text == FRANCE_ANSWER[: FRANCE_ANSWER.index("is Par")]
    short = client.responses.create(model="smollm2", input=FRANCE, temperature=0, max_output_tokens=3)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model="smollm2", input=FRANCE, previous_response_id=whole.id)
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0


@pytest.mark.slow
def test_output_text_logprobs_are_the_chat_routes(client: openai.OpenAI):
    kwargs = dict(model="smollm2", temperature=0)
    # Both from the prefix cache (the suite's float32 activations round a prompt computed whole and one
    # computed after a cached prefix differently; the default int16 ones do not).
    client.chat.completions.create(messages=[{"role": "user", "content": FRANCE}], max_tokens=1, **kwargs)
    chat = client.chat.completions.create(
        messages=[{"role": "user", "content": FRANCE}], max_tokens=8, logprobs=True, top_logprobs=2, **kwargs
    )
    expected = [
        (t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in chat.choices[0].logprobs.content
    ]
    include = ["message.output_text.logprobs"]
    whole = client.responses.create(
        input=FRANCE, max_output_tokens=8, include=include, top_logprobs=2, **kwargs
    )
    part = whole.output[0].content[0]
    got = [(t.token, t.logprob, [a.token for a in t.top_logprobs]) for t in part.logprobs]
    assert [(t, a) for t, _, a in got] == [(t, a) for t, _, a in expected] and len(got) == 7
    assert all(abs(g[1] - e[1]) < 1e-4 for g, e in zip(got, expected))
    with client.responses.stream(
        input=FRANCE, max_output_tokens=8, include=include, top_logprobs=2, **kwargs
    ) as s:
        streamed = [t.token for e in s if e.type == "response.output_text.delta" for t in e.logprobs]
    assert streamed == [t for t, _, _ in expected]
    plain = client.responses.create(input=FRANCE, max_output_tokens=8, **kwargs)
    assert plain.output[0].content[0].logprobs == []  # not asked for
    only_count = client.responses.create(input=FRANCE, max_output_tokens=8, top_logprobs=2, **kwargs)
    assert only_count.output[0].content[0].logprobs == []  # as OpenAI's: include asks, not top_logprobs
    # Characters split across tokens (emoji, CJK): each piece's bytes, joined, spell the text.
    split = "Repeat exactly: 😀 café 🎉 naïve 日本語"
    pieces = client.responses.create(input=split, max_output_tokens=24, include=include, **kwargs)
    part = pieces.output[0].content[0]
    assert "🎉" in part.text and "日本語" in part.text  # (the greedy answer this test relies on)
    assert bytes(b for t in part.logprobs for b in t.bytes).decode("utf-8") == part.text
    assert any(t.token.startswith("bytes:\\x") for t in part.logprobs)  # a piece of a character
    assert all("\ufffd" not in t.token for t in part.logprobs)
