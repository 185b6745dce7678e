"""``mlx-infer serve`` on the real SmolLM2 model, driven by the official ``openai`` client.

One server per module (a subprocess on a free loopback port). Token counts are checked against the
tokenizer read straight from the GGUF, texts against the same request served alone.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
from server_helpers import LiveServer, wait_for_idle

from mlx_infer.loading.gguf_file import read_header
from mlx_infer.tokenizer import Tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

REFERENCES = json.loads((Path(__file__).parent / "oracle" / "smollm2_references.json").read_text())
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
FRANCE_ANSWER = "The capital of France is Paris."  # greedy, see /work/shared/MODELS.md
LOGPROB_EPS = 1e-4
METRIC_NAMES = [
    "mlx_infer_requests_running",
    "mlx_infer_requests_waiting",
    "mlx_infer_kv_blocks_total",
    "mlx_infer_kv_blocks_used",
    "mlx_infer_requests_finished_total",
    "mlx_infer_kv_blocks_cached",
    "mlx_infer_prefix_cache_hit_rate",
    "mlx_infer_generation_tokens_total",
    "mlx_infer_generation_tokens_per_second",
    "mlx_infer_time_to_first_token_seconds_bucket",
    "mlx_infer_time_per_output_token_seconds_bucket",
    "mlx_infer_spec_proposed_tokens_total",
    "mlx_infer_spec_accepted_tokens_total",
    "mlx_infer_spec_acceptance_rate",
]


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    live = LiveServer(smollm2_path, "--kv-memory", "0.5")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def tok(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf_metadata(read_header(smollm2_path).metadata)


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def async_client(server: LiveServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=180)


def n_tokens(tok: Tokenizer, text: str) -> int:
    return len(tok.encode(text, add_special_tokens=False))


def random_words(seed: int, count: int) -> str:
    rng = random.Random(seed)
    words = [
        "river",
        "stone",
        "lamp",
        "orbit",
        "maple",
        "violet",
        "copper",
        "harbor",
        "meadow",
        "signal",
        "candle",
        "glacier",
        "thunder",
        "pepper",
        "saddle",
        "window",
        "lantern",
        "marble",
        "falcon",
    ]
    return " ".join(rng.choice(words) for _ in range(count))


# ---- simple routes --------------------------------------------------------------------------------
def test_models_health_and_metrics(server: LiveServer, client: openai.OpenAI):
    assert [m.id for m in client.models.list().data] == ["smollm2"]
    card = client.models.retrieve("smollm2")  # GET /v1/models/{id}
    assert card.id == "smollm2" and card.model_dump()["context_length"] == 8192
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("nope")
    assert missing.value.body["code"] == "model_not_found"  # OpenAI's shape (the client unwraps "error")
    assert missing.value.request_id.startswith("req_")  # x-request-id, on errors too
    assert client.models.with_raw_response.list().headers["x-request-id"].startswith("req_")
    assert httpx.get(f"{server.base_url}/health").json() == {"status": "ok"}
    text = httpx.get(f"{server.base_url}/metrics").text
    for name in METRIC_NAMES:
        assert f"\n{name}" in text, name
    finished = server.metrics()["mlx_infer_requests_finished_total"]
    client.completions.create(model="smollm2", prompt="Hi", max_tokens=1)
    assert server.metrics()["mlx_infer_requests_finished_total"] == finished + 1
    assert server.metrics()["mlx_infer_kv_blocks_total"] > 0


# ---- chat -----------------------------------------------------------------------------------------
def test_chat_usage_equals_tokenizer_counts(client: openai.OpenAI, tok: Tokenizer):
    r = client.chat.completions.create(model="smollm2", messages=FRANCE, temperature=0, max_tokens=32)
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == FRANCE_ANSWER
    assert choice.finish_reason == "stop"
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-")
    assert r.usage.prompt_tokens == len(tok.encode_chat(FRANCE))
    # The end-of-turn token that stopped generation counts as a completion token (as in OpenAI and vLLM).
    assert r.usage.completion_tokens == n_tokens(tok, FRANCE_ANSWER) + 1
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_matches_non_streaming(client: openai.OpenAI, tok: Tokenizer):
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=FRANCE,
            temperature=0,
            max_tokens=32,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    with_choices = [c for c in chunks if c.choices]
    assert all(c.object == "chat.completion.chunk" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in with_choices) == FRANCE_ANSWER
    assert [c.choices[0].finish_reason for c in with_choices][-1] == "stop"
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    # include_usage: every chunk has usage null except a last one with no choices.
    assert all(c.usage is None for c in with_choices)
    last = chunks[-1]
    assert last.choices == []
    assert last.usage.prompt_tokens == len(tok.encode_chat(FRANCE))
    assert last.usage.completion_tokens == n_tokens(tok, FRANCE_ANSWER) + 1


def test_chat_max_completion_tokens_gives_length(client: openai.OpenAI, tok: Tokenizer):
    r = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_completion_tokens=3
    )
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 3
    assert r.choices[0].message.content == tok.decode(tok.encode(FRANCE_ANSWER, add_special_tokens=False)[:3])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("stop", [" Paris", "is Par"])  # one token; a string spanning two tokens
def test_chat_stop_string(client: openai.OpenAI, stop: str, stream: bool):
    kwargs = dict(model="smollm2", messages=FRANCE, temperature=0, max_tokens=32, stop=[stop, "never"])
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        pieces = [c.choices[0].delta.content or "" for c in chunks if c.choices]
        text, finish = "".join(pieces), chunks[-1].choices[0].finish_reason
        assert not any(stop in p for p in pieces)
    else:
        r = client.chat.completions.create(**kwargs)
        text, finish = r.choices[0].message.content, r.choices[0].finish_reason
    assert text == FRANCE_ANSWER[: FRANCE_ANSWER.index(stop)]
    assert stop not in text
    assert finish == "stop"


def test_chat_n2(client: openai.OpenAI):
    greedy = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_tokens=12, n=2
    )
    assert [c.index for c in greedy.choices] == [0, 1]
    assert greedy.choices[0].message.content == greedy.choices[1].message.content == FRANCE_ANSWER
    sampled = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=1.0, max_tokens=8, n=2, seed=7
    )
    assert [c.index for c in sampled.choices] == [0, 1]
    assert all(c.message.content for c in sampled.choices)
    assert sampled.usage.completion_tokens <= 16


def test_chat_logprobs_greedy(client: openai.OpenAI, tok: Tokenizer):
    r = client.chat.completions.create(
        model="smollm2", messages=FRANCE, temperature=0, max_tokens=32, logprobs=True, top_logprobs=3
    )
    entries = r.choices[0].logprobs.content
    # The entries spell the content, as OpenAI's: the end-of-turn token that stopped it (counted in the
    # usage) has none.
    assert r.choices[0].finish_reason == "stop" and len(entries) == r.usage.completion_tokens - 1
    assert "".join(e.token for e in entries) == r.choices[0].message.content
    for e in entries:
        assert len(e.top_logprobs) == 3
        assert e.logprob <= 0 and all(t.logprob <= 0 for t in e.top_logprobs)
        assert [t.logprob for t in e.top_logprobs] == sorted(
            (t.logprob for t in e.top_logprobs), reverse=True
        )
        assert e.logprob >= e.top_logprobs[0].logprob - LOGPROB_EPS  # greedy picks the best
        assert e.top_logprobs[0].token == e.token
        assert e.bytes == list(e.token.encode())


def test_chat_matches_transformers_references_in_one_batch(server: LiveServer):
    """The reference conversations (English, code, German, French, Russian, Chinese, Japanese, digits,
    multi-turn), sent at once, each equal transformers' float32 greedy output on the same GGUF, with
    usage equal to transformers' token counts."""
    generations = REFERENCES["generations"]

    async def all_at_once():
        async with async_client(server) as aclient:
            return await asyncio.gather(
                *(
                    aclient.chat.completions.create(
                        model="smollm2",
                        messages=g["messages"],
                        temperature=0,
                        max_tokens=REFERENCES["max_new_tokens"],
                    )
                    for g in generations
                )
            )

    for g, r in zip(generations, asyncio.run(all_at_once())):
        assert r.choices[0].message.content == g["output_text"], g["name"]
        assert r.choices[0].finish_reason == g["finish_reason"], g["name"]
        assert r.usage.prompt_tokens == len(g["prompt_ids"]), g["name"]
        assert r.usage.completion_tokens == len(g["output_ids"]), g["name"]


# ---- completions ----------------------------------------------------------------------------------
def test_completions_stream_and_not(client: openai.OpenAI, tok: Tokenizer):
    prompt = "Once upon a time"
    r = client.completions.create(model="smollm2", prompt=prompt, temperature=0, max_tokens=12)
    text = r.choices[0].text
    assert r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == len(tok.encode(prompt))
    assert r.usage.completion_tokens == 12 == n_tokens(tok, text)
    chunks = list(
        client.completions.create(
            model="smollm2",
            prompt=prompt,
            temperature=0,
            max_tokens=12,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    with_choices = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in with_choices) == text
    assert with_choices[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == r.usage.prompt_tokens


def test_completions_n2_stream(client: openai.OpenAI):
    alone = client.completions.create(model="smollm2", prompt="The ocean is", temperature=0, max_tokens=10)
    chunks = list(
        client.completions.create(
            model="smollm2", prompt="The ocean is", temperature=0, max_tokens=10, n=2, stream=True
        )
    )
    texts, finishes = ["", ""], [None, None]
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.text
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    assert texts == [alone.choices[0].text] * 2
    assert finishes == ["length", "length"]


def test_completions_of_a_batch_of_prompts(client: openai.OpenAI, tok: Tokenizer):
    """A list of prompts (text or token ids) gets n choices each, numbered prompt by prompt, each the
    answer its prompt gets alone; usage counts every prompt."""
    prompts = ["The ocean is", "Once upon a time"]
    kwargs = dict(model="smollm2", temperature=0, max_tokens=6)
    alone = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, echo=True, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [p + a for p, a in zip(prompts, alone) for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert batch.usage.completion_tokens == 4 * 6
    ids = [tok.encode(p) for p in prompts]
    texts = ["", ""]
    for chunk in client.completions.create(prompt=ids, stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == alone
    with pytest.raises(openai.BadRequestError):
        client.completions.create(prompt=["w", ""], **kwargs)


def test_completions_logprobs(client: openai.OpenAI):
    r = client.completions.create(
        model="smollm2", prompt="The sky is", temperature=0, max_tokens=8, logprobs=2
    )
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    assert "".join(lp.tokens) == text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(8)]
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2 and all(v <= 0 for v in top.values())
        assert chosen <= 0
        assert chosen >= max(top.values()) - LOGPROB_EPS
        assert token in top
    # Sampled: the chosen token is in its entry whether or not it is among the best (up to logprobs + 1
    # entries, as OpenAI's legacy API and vLLM), and alone there with logprobs 0.
    for count in (0, 1):
        r = client.completions.create(
            model="smollm2", prompt="Once upon a time", temperature=1.5, seed=101, max_tokens=12,
            logprobs=count,
        )
        lp = r.choices[0].logprobs
        for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
            assert top[token] == chosen and 1 <= len(top) <= count + 1
        assert count or all(len(top) == 1 for top in lp.top_logprobs)
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the best


def test_completions_logprobs_of_the_pieces_of_a_character(client: openai.OpenAI):
    # An echoed prompt of emoji and CJK, which the tokenizer splits: each piece is a "bytes:" token and the
    # pieces of one character share the offset where it starts in the text.
    text = "Hi 😀 日本"
    r = client.completions.create(
        model="smollm2", prompt=text, echo=True, logprobs=1, max_tokens=0, temperature=0
    )
    lp = r.choices[0].logprobs
    assert r.choices[0].text == text
    assert any(t.startswith("bytes:\\x") for t in lp.tokens) and all("\ufffd" not in t for t in lp.tokens)
    pieces = [
        bytes.fromhex(t[6:].replace("\\x", "")) if t.startswith("bytes:") else t.encode() for t in lp.tokens
    ]
    assert b"".join(pieces).decode("utf-8") == text
    starts = [len(b"".join(pieces[:i]).decode("utf-8", errors="ignore")) for i in range(len(pieces))]
    assert lp.text_offset == starts and lp.text_offset[-1] == text.index("本")


def test_completions_echo_scores_the_prompt_as_the_oracle_does(client: openai.OpenAI):
    """Echo with logprobs gives each prompt token's log-probability given the tokens before it (what
    lm-evaluation-harness reads), max_tokens 0 only those; checked against transformers' teacher-forced
    log-probabilities (tests/oracle), streamed and not, after the same prompt was cached."""
    oracle = json.loads((Path(__file__).parent / "oracle" / "smollm2_teacher_forced.json").read_text())
    ids = oracle["token_ids"][:48]
    kwargs = dict(model="smollm2", prompt=ids, temperature=0, echo=True, logprobs=3)
    client.completions.create(model="smollm2", prompt=ids, max_tokens=1)  # its blocks are now cached
    scored = client.completions.create(max_tokens=0, **kwargs).choices[0]
    lp = scored.logprobs
    assert scored.finish_reason == "length" and len(lp.tokens) == len(ids)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert "".join(lp.tokens) == scored.text
    for p in range(1, len(ids)):
        position = oracle["positions"][p - 1]
        top = lp.top_logprobs[p]
        assert len(top) in (3, 4) and top[lp.tokens[p]] == lp.token_logprobs[p] <= 0
        if ids[p] in position["ids"]:
            expected = position["logprobs"][position["ids"].index(ids[p])]
            assert lp.token_logprobs[p] == pytest.approx(expected, abs=0.01), p
        # The best next token as the oracle's, where the oracle's margin leaves no doubt.
        if position["logprobs"][0] - position["logprobs"][1] > 0.05:
            best = max(top, key=top.get)
            assert top[best] == pytest.approx(position["logprobs"][0], abs=0.01), p
    # With tokens generated after the prompt: the prompt's entries, then theirs (streamed the same).
    generated = client.completions.create(max_tokens=4, **kwargs).choices[0]
    glp = generated.logprobs
    assert len(glp.tokens) == len(ids) + 4 and glp.token_logprobs[: len(ids)] == lp.token_logprobs
    assert generated.text.startswith(scored.text) and glp.text_offset[len(ids)] == len(scored.text)
    text, tokens, values = "", [], []
    for chunk in client.completions.create(max_tokens=4, stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            tokens += choice.logprobs.tokens if choice.logprobs else []
            values += choice.logprobs.token_logprobs if choice.logprobs else []
    assert (text, tokens, values) == (generated.text, glp.tokens, glp.token_logprobs)
    with pytest.raises(openai.BadRequestError, match="echo"):
        client.completions.create(model="smollm2", prompt=ids, max_tokens=0)


def test_a_body_may_leave_out_the_model_of_a_one_model_server(server: LiveServer):
    for path, body in (
        ("/v1/chat/completions", {"messages": FRANCE, "max_tokens": 2}),
        ("/v1/completions", {"prompt": "The sky is", "max_tokens": 2}),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 2}),
    ):
        r = httpx.post(server.base_url + path, json=body, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "smollm2", (path, r.text)


def test_vllm_sampling_fields(client: openai.OpenAI, tok: Tokenizer):
    """stop_token_ids, min_tokens, include_stop_str_in_output and continue_final_message do what vLLM's
    do; the ending token has no logprobs entry (they spell the content); what is not supported is a 400."""
    sky = [{"role": "user", "content": "Explain in two sentences why the sky is blue."}]
    kwargs = dict(model="smollm2", temperature=0)
    plain = client.chat.completions.create(messages=sky, max_tokens=10, logprobs=True, **kwargs).choices[0]
    assert plain.message.content.startswith("The sky is blue")
    blue = tok.encode(plain.message.content, add_special_tokens=False)[3]
    assert tok.decode([blue]) == " blue"
    cut = client.chat.completions.create(
        messages=sky, max_tokens=10, extra_body={"stop_token_ids": [blue]}, **kwargs
    )
    assert (cut.choices[0].message.content, cut.choices[0].finish_reason) == ("The sky is", "stop")
    kept = client.chat.completions.create(
        messages=sky, max_tokens=30, stop="blue", extra_body={"include_stop_str_in_output": True}, **kwargs
    )
    assert kept.choices[0].message.content == "The sky is blue"

    hi = [{"role": "user", "content": "Say hi"}]
    short = client.chat.completions.create(messages=hi, max_tokens=100, logprobs=True, **kwargs)
    ended = short.choices[0]
    assert ended.finish_reason == "stop" and short.usage.completion_tokens < 90
    assert "".join(t.token for t in ended.logprobs.content) == ended.message.content
    floor = short.usage.completion_tokens + 5
    longer = client.chat.completions.create(
        messages=hi, max_tokens=100, extra_body={"min_tokens": floor}, **kwargs
    )
    assert longer.usage.completion_tokens >= floor
    assert longer.choices[0].message.content.startswith(ended.message.content)

    started = FRANCE + [{"role": "assistant", "content": "The capital of France is"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    going_on = client.chat.completions.create(messages=started, max_tokens=10, extra_body=extra, **kwargs)
    assert "The capital of France is" + going_on.choices[0].message.content == FRANCE_ANSWER

    chat, complete = client.chat.completions.create, client.completions.create
    refused = [
        (chat, dict(messages=started, extra_body={"continue_final_message": True})),
        (chat, dict(messages=FRANCE, modalities=["text", "audio"])),
        (chat, dict(messages=FRANCE, functions=[{"name": "f", "parameters": {"type": "object"}}])),
        (chat, dict(messages=FRANCE, function_call="auto")),
        (complete, dict(prompt="def f(", suffix="return 1")),
        (complete, dict(prompt="Once", best_of=3)),
        (complete, dict(prompt="Once", extra_body={"min_tokens": 5})),
    ]
    for create, fields in refused:
        with pytest.raises(openai.BadRequestError):
            create(model="smollm2", max_tokens=2, **fields)
    with pytest.raises(openai.BadRequestError) as long_prompt:
        client.chat.completions.create(messages=[{"role": "user", "content": "hello " * 9000}], **kwargs)
    assert long_prompt.value.body["param"] == "messages"
    assert long_prompt.value.code == "context_length_exceeded"  # OpenAI's code, which agents trim on


# ---- concurrency ----------------------------------------------------------------------------------
CONCURRENT_PROMPTS = [
    "Name a fruit.",
    "What is 2 plus 2?",
    "Describe the sea.",
    "Who wrote Hamlet?",
    "What color is grass?",
    "Give me a synonym for happy.",
    "What is the boiling point of water?",
    "Tell me about cats.",
    "How many legs does a spider have?",
    "What is the largest planet?",
    "Write a haiku about rain.",
    "Why is the sky blue?",
    "What is a noun?",
    "Suggest a name for a dog.",
    "What do bees make?",
    "Explain gravity briefly.",
]


def test_16_concurrent_streams_equal_solo_runs(server: LiveServer, client: openai.OpenAI):
    def messages(p: str) -> list[dict]:
        return [{"role": "user", "content": p}]

    solo = [
        client.chat.completions.create(model="smollm2", messages=messages(p), temperature=0, max_tokens=24)
        .choices[0]
        .message.content
        for p in CONCURRENT_PROMPTS
    ]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.chat.completions.create(
            model="smollm2", messages=messages(prompt), temperature=0, max_tokens=24, stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def all_at_once() -> list[str]:
        async with async_client(server) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in CONCURRENT_PROMPTS))

    assert asyncio.run(all_at_once()) == solo
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0


# ---- prefix caching -------------------------------------------------------------------------------
def _stream_ttft(client: openai.OpenAI, prompt: str) -> tuple[float, int, str]:
    """(seconds to the first streamed text, cached prompt tokens, text) of a 4-token greedy completion."""
    start = time.perf_counter()
    ttft, text, cached = None, "", None
    for c in client.completions.create(
        model="smollm2",
        prompt=prompt,
        temperature=0,
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    ):
        if c.choices and c.choices[0].text and ttft is None:
            ttft = time.perf_counter() - start
        text += c.choices[0].text if c.choices else ""
        if c.usage is not None:
            cached = c.usage.prompt_tokens_details.cached_tokens
    return ttft, cached, text


def test_prefix_cache_hit_lowers_ttft(client: openai.OpenAI, tok: Tokenizer):
    prefix = "Read these words carefully.\n" + random_words(1234, 1000) + "\n\n"
    first_prompt, second_prompt = prefix + "Question: which word comes first?", prefix + "Summarise them:"
    first_ids, second_ids = tok.encode(first_prompt), tok.encode(second_prompt)
    common = next(i for i, (a, b) in enumerate(zip(first_ids, second_ids)) if a != b)
    assert common >= 1000

    first_ttft, first_cached, _ = _stream_ttft(client, first_prompt)
    second_ttft, second_cached, _ = _stream_ttft(client, second_prompt)
    assert first_cached == 0
    # Every full block of the shared prefix is found, and nothing beyond it.
    assert second_cached == common // 16 * 16 >= 1000 - 16
    assert second_ttft < first_ttft, (first_ttft, second_ttft)


# ---- disconnects ----------------------------------------------------------------------------------
def test_disconnect_mid_stream_frees_blocks(server: LiveServer):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 2000,
        "ignore_eos": True,
        "stream": True,
    }
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.base_url}/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            chunks = 0
            for line in response.iter_lines():
                chunks += line.startswith("data: ")
                if chunks == 4:
                    # Mid-stream the request holds blocks; leaving the loop closes the connection.
                    assert server.metrics()["mlx_infer_kv_blocks_used"] > 0
                    break
    m = wait_for_idle(server)
    assert m["mlx_infer_kv_blocks_used"] == 0
    assert m["mlx_infer_requests_running"] == 0


def test_disconnect_while_waiting_non_streaming(server: LiveServer):
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": "Count to one thousand."}],
        "max_tokens": 2000,
        "ignore_eos": True,
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=1.5)
    m = wait_for_idle(server)
    assert m["mlx_infer_kv_blocks_used"] == 0
    assert m["mlx_infer_requests_running"] == 0


# ---- the serve benchmark, against this server -----------------------------------------------------
def test_bench_serve_smoke(server: LiveServer, tmp_path: Path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_serve

    out = tmp_path / "serve.json"
    argv = ["--base-url", f"{server.base_url}/v1", "--num-requests", "3", "--concurrency", "1,2"]
    argv += ["--input-words", "12", "--output-tokens", "5", "--shared-prefix", "40", "--json", str(out)]
    assert bench_serve.main(argv) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["concurrency"] for r in results] == [1, 2]
    for r in results:
        assert r["errors"] == 0 and r["output_tokens"] == 3 * 5  # ignore_eos: exactly max_tokens each
        assert 0 < r["ttft"]["p50"] <= r["latency"]["p50"] and r["output_tokens_per_second"] > 0
        # The three prompts of a level share a 40-word prefix (2+ blocks): at least the last finds it.
        assert r["mean_cached_tokens"] >= 32 / 3
    prompts = [bench_serve.level_prompts(7, c, bench_serve.parse_args(argv)) for c in (1, 2)]
    assert not set(prompts[0]) & set(prompts[1])  # fresh words for every level
