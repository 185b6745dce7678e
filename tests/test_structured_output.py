"""Structured output on ``mlx-infer serve`` with the real SmolLM2, driven by the official ``openai`` client.

Every answer to a constrained request must parse and validate (``jsonschema``), at temperature 0 and 1;
regex, choice, Lark and GBNF constraints are honoured whichever field (OpenAI, vLLM, llama.cpp) carries
them; free requests that share the batch with constrained ones answer as they do alone; a constraint that
does not compile is a 400 before anything is generated.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import openai
import pytest
from server_helpers import LiveServer, wait_for_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

SHORT = {"type": "string", "maxLength": 12}
SCHEMAS = {
    "nested": {
        "type": "object",
        "properties": {
            "name": SHORT,
            "address": {
                "type": "object",
                "properties": {"city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["name", "address"],
        "additionalProperties": False,
    },
    "array": {
        "type": "object",
        "properties": {"colors": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 3}},
        "required": ["colors"],
        "additionalProperties": False,
    },
    "enum": {
        "type": "object",
        "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "sure": {"type": "boolean"}},
        "required": ["answer", "sure"],
        "additionalProperties": False,
    },
    "integers": {
        "type": "object",
        "properties": {
            "year": {"type": "integer", "minimum": 1900, "maximum": 2100},
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        },
        "required": ["year", "rating"],
        "additionalProperties": False,
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
        "required": ["code"],
        "additionalProperties": False,
    },
}
ASK = "Describe a person, a city, colors, a year and a rating as JSON."


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    live = LiveServer(smollm2_path, "--kv-memory", "0.5")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def _gather(server: LiveServer, calls: list[dict], endpoint: str = "chat") -> list:
    """Send every call at once (so they share the engine's steps); returns the responses in order."""

    async def run():
        client = openai.AsyncOpenAI(
            base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        )
        create = client.chat.completions.create if endpoint == "chat" else client.completions.create
        async with client:
            return await asyncio.gather(*(create(model="smollm2", **call) for call in calls))

    return asyncio.run(run())


def _chat(content: str, **kw) -> dict:
    return {"messages": [{"role": "user", "content": content}], **kw}


def test_json_schemas_validate_at_temperature_0_and_1(server: LiveServer):
    calls = [
        _chat(
            ASK,
            max_tokens=120,
            temperature=temperature,
            seed=5,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": name, "schema": s, "strict": True},
            },
        )
        for name, s in SCHEMAS.items()
        for temperature in (0.0, 1.0)
    ]
    for call, response in zip(calls, _gather(server, calls)):
        choice = response.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        schema = call["response_format"]["json_schema"]["schema"]
        jsonschema.validate(json.loads(choice.message.content), schema)
    wait_for_idle(server)


def test_every_field_that_carries_a_constraint_is_honoured(server: LiveServer):
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/\n'
    gbnf = 'root ::= "Colors: " color (", " color)? (", " color)?\ncolor ::= "red" | "green" | "blue"\n'
    cases = [
        (dict(extra_body={"guided_regex": r"[A-Z][a-z]{2,8} [0-9]{2}"}), r"[A-Z][a-z]{2,8} [0-9]{2}"),
        (dict(extra_body={"guided_choice": ["Paris", "London", "Rome"]}), r"Paris|London|Rome"),
        (dict(extra_body={"guided_grammar": lark}), r"The answer is [0-9]{1,3}\."),
        (dict(extra_body={"grammar": gbnf}), r"Colors: (red|green|blue)(, (red|green|blue)){0,2}"),
        (dict(extra_body={"structured_outputs": {"regex": r"(yes|no)!"}}), r"(yes|no)!"),
        (dict(extra_body={"structured_outputs": {"choice": ["up", "down"]}}), r"up|down"),
    ]
    calls = [
        _chat("What is the capital of France?", max_tokens=60, temperature=t, seed=1, **kw)
        for kw, _ in cases
        for t in (0.0, 1.0)
    ]
    # Any JSON object may go on for long at temperature 1: greedy only.
    calls.append(
        _chat(
            "What is the capital of France?",
            max_tokens=60,
            temperature=0.0,
            response_format={"type": "json_object"},
        )
    )
    responses = _gather(server, calls)
    for i, (_, pattern) in enumerate(c for c in cases for _ in (0, 1)):
        text = responses[i].choices[0].message.content
        assert responses[i].choices[0].finish_reason == "stop", text
        assert re.fullmatch(pattern, text, re.DOTALL), (pattern, text)
    assert responses[-1].choices[0].finish_reason == "stop"
    assert isinstance(json.loads(responses[-1].choices[0].message.content), dict)


def test_completions_endpoint_and_llama_cpp_fields(server: LiveServer):
    schema = SCHEMAS["integers"]
    calls = [
        dict(
            prompt="A year and a rating in JSON:",
            max_tokens=60,
            temperature=0.0,
            extra_body={
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            },
        ),
        dict(prompt="JSON:", max_tokens=60, temperature=0.0, extra_body={"json_schema": schema}),
        dict(
            prompt="JSON:",
            max_tokens=60,
            temperature=1.0,
            seed=2,
            extra_body={"guided_json": json.dumps(schema)},
        ),
    ]
    for response in _gather(server, calls, endpoint="completions"):
        assert response.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(response.choices[0].text), schema)


def test_streamed_constrained_answer_reassembles(client: openai.OpenAI):
    kw = dict(
        model="smollm2",
        max_tokens=120,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}},
        **_chat(ASK),
    )
    whole = client.chat.completions.create(**kw).choices[0].message.content
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole
    assert chunks[-1].choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(whole), SCHEMAS["nested"])


def test_sixteen_concurrent_half_constrained(server: LiveServer, client: openai.OpenAI):
    topics = ["the sea", "a cat", "music", "the moon", "bread", "a train", "winter", "a garden"]
    free = [_chat(f"Write one sentence about {t}.", max_tokens=20, temperature=0.0) for t in topics]
    solo = [client.chat.completions.create(model="smollm2", **c).choices[0].message.content for c in free]
    constrained = [
        _chat(
            f"Describe {t} as JSON.",
            max_tokens=80,
            temperature=1.0,
            seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS["array"]}},
        )
        for i, t in enumerate(topics)
    ]
    calls = [c for pair in zip(free, constrained) for c in pair]
    responses = _gather(server, calls)
    assert [r.choices[0].message.content for r in responses[0::2]] == solo
    for r in responses[1::2]:
        jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMAS["array"])
    wait_for_idle(server)


@pytest.mark.parametrize(
    "extra,needle",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "JSON schema",
        ),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "json_schema.name"),
        ({"guided_regex": "(unclosed"}, "regex"),
        ({"guided_grammar": "root ::= ("}, "grammar"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "one output constraint"),
    ],
    ids=["schema", "unnamed-schema", "regex", "grammar", "format-type", "two-fields"],
)
def test_bad_constraints_are_400_before_generation(server: LiveServer, client: openai.OpenAI, extra, needle):
    before = server.metrics()["mlx_infer_generation_tokens_total"]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="smollm2", max_tokens=8, extra_body=extra, **_chat("Hi"))
    assert needle in str(info.value)
    assert server.metrics()["mlx_infer_generation_tokens_total"] == before


def _generate(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "mlx_infer.cli", "generate", *args]
    return subprocess.run(
        command, capture_output=True, text=True, timeout=180, env={**os.environ, "HF_HUB_OFFLINE": "1"}
    )


def test_generate_json_schema_and_grammar_files(smollm2_path: Path, tmp_path: Path):
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS["integers"]))
    grammar_file = tmp_path / "answer.gbnf"
    grammar_file.write_text('root ::= "Answer: " ("yes" | "no")\n')
    ask = ["-m", str(smollm2_path), "-p", "Is Paris in France?", "--max-tokens", "40"]
    done = _generate(*ask, "--json-schema", str(schema_file))
    assert done.returncode == 0, done.stderr
    jsonschema.validate(json.loads(done.stdout), SCHEMAS["integers"])
    done = _generate(*ask, "--grammar", str(grammar_file))
    assert done.returncode == 0 and re.fullmatch(r"Answer: (yes|no)\n", done.stdout), done.stdout
    (tmp_path / "bad.json").write_text("{bad")
    (tmp_path / "bad.gbnf").write_text("root ::= (\n")
    for flag, name, needle in (
        ("--json-schema", "bad.json", "not valid JSON"),
        ("--grammar", "bad.gbnf", "GBNF"),
    ):
        done = _generate(*ask, flag, str(tmp_path / name))
        assert done.returncode == 2 and needle in done.stderr
        errors = [line for line in done.stderr.splitlines() if "error" in line]
        assert len(errors) == 1 and errors[0].startswith("mlx-infer generate: error:"), done.stderr
