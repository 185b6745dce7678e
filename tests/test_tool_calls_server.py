"""Tool calls and reasoning through ``mlx-infer serve`` on the real SmolLM2, with the official client.

SmolLM2's family is detected from its chat template (``smollm2``: ``<tool_call>[...]</tool_call>``);
``required`` and named tool choices are forced by a grammar over that syntax, so every call must parse
and its arguments validate against the tool's schema, whatever the temperature.
"""

from __future__ import annotations

import enum
import json
from pathlib import Path

import anthropic
import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel
from server_helpers import LiveServer, wait_for_idle

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Local time in a time zone, and the date some days ahead.",
        "parameters": {
            "type": "object",
            "properties": {
                "zone": {"type": "string", "pattern": "^[A-Z][a-z]{2,8}/[A-Z][a-z]{2,8}$"},
                "days_ahead": {"type": "integer", "minimum": 0, "maximum": 7},
            },
            "required": ["zone", "days_ahead"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris, and what time is it there?"}]


@pytest.fixture(scope="module")
def server(smollm2_path: Path):
    # The <think> split is forced on: SmolLM2 never opens a block itself, a grammar makes it (below).
    live = LiveServer(smollm2_path, "--kv-memory", "0.5", "--reasoning-parser", "think")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _valid_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    assert message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize(
    "tool_choice, names",
    [
        ("required", {"get_weather", "get_time"}),
        ({"type": "function", "function": {"name": "get_time"}}, {"get_time"}),
    ],
)
def test_forced_calls_always_validate(client: openai.OpenAI, tool_choice, names, temperature):
    for seed in range(3 if temperature else 1):
        response = client.chat.completions.create(
            model="smollm2",
            messages=QUESTION,
            tools=TOOLS,
            tool_choice=tool_choice,
            parallel_tool_calls=False,
            temperature=temperature,
            seed=seed,
            max_tokens=80,
        )
        choice = response.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert len(_valid_calls(choice.message, names)) == 1
        assert choice.message.content is None


def test_streamed_call_reassembles_to_the_non_streamed_one(client: openai.OpenAI):
    kwargs = dict(
        model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=80
    )
    whole = client.chat.completions.create(**kwargs).choices[0]
    calls: dict[int, dict] = {}
    finish = None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        choice = chunk.choices[0]
        finish = choice.finish_reason or finish
        for delta in choice.delta.tool_calls or []:
            if delta.index not in calls:
                # OpenAI's order: id, type and name first, with empty arguments.
                assert delta.id and delta.type == "function" and delta.function.arguments == ""
                calls[delta.index] = {"name": delta.function.name, "arguments": ""}
            else:
                assert delta.id is None and delta.function.name is None
                calls[delta.index]["arguments"] += delta.function.arguments
    assert finish == whole.finish_reason == "tool_calls"
    expected = [
        {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls
    ]
    assert [calls[i] for i in sorted(calls)] == expected
    assert sum(len(c["arguments"]) > 0 for c in calls.values()) == len(calls)


def test_agent_loop_two_calls_then_an_answer(server: LiveServer, client: openai.OpenAI):
    messages = list(QUESTION)
    results = {"get_weather": '{"temperature": 18, "unit": "celsius"}', "get_time": '{"time": "14:05"}'}
    for name in ("get_weather", "get_time"):
        response = client.chat.completions.create(
            model="smollm2",
            messages=messages,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": name}},
            temperature=0,
            max_tokens=80,
        )
        message = response.choices[0].message
        (call,) = message.tool_calls
        _valid_calls(message, {name})
        messages.append(message.model_dump(exclude_none=True))
        messages.append({"role": "tool", "tool_call_id": call.id, "content": results[name]})
    final = client.chat.completions.create(
        model="smollm2", messages=messages, tools=TOOLS, tool_choice="auto", temperature=0, max_tokens=40
    )
    choice = final.choices[0]
    assert choice.finish_reason in ("stop", "length") and not choice.message.tool_calls
    assert choice.message.content.strip()
    # Both calls and both results reached the prompt (tokens beyond the question's).
    alone = client.chat.completions.create(model="smollm2", messages=QUESTION, tools=TOOLS, max_tokens=1)
    assert final.usage.prompt_tokens > alone.usage.prompt_tokens + 40
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0


def test_forced_call_cut_by_max_tokens_leaks_no_markup(client: openai.OpenAI, claude: anthropic.Anthropic):
    kwargs = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0)
    cut = client.chat.completions.create(**kwargs, max_tokens=6).choices[0]
    assert cut.finish_reason == "length" and not cut.message.content
    streamed = client.chat.completions.create(**kwargs, max_tokens=6, stream=True)
    assert not "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    reply = claude.messages.create(
        model="smollm2", max_tokens=6, messages=QUESTION, tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}
    )
    assert reply.stop_reason == "max_tokens" and all(b.type != "text" or not b.text for b in reply.content)
    # Cut inside its arguments: still max_tokens, not a tool_use to run with an incomplete input.
    for stream in (False, True):
        kwargs = dict(model="smollm2", max_tokens=18, messages=QUESTION, tools=ANTHROPIC_TOOLS)
        if stream:
            with claude.messages.stream(**kwargs, tool_choice={"type": "any"}) as s:
                reply = s.get_final_message()
        else:
            reply = claude.messages.create(**kwargs, tool_choice={"type": "any"})
        assert any(b.type == "tool_use" for b in reply.content)
        assert reply.stop_reason == "max_tokens"


def test_stop_strings_do_not_cut_a_forced_call(client: openai.OpenAI, claude: anthropic.Anthropic):
    # "Paris" would cut the call inside its arguments; the grammar, not a stop string, ends a forced call.
    kwargs = dict(model="smollm2", messages=QUESTION, tools=TOOLS, tool_choice="required", temperature=0)
    whole = client.chat.completions.create(**kwargs, stop=["Paris"]).choices[0]
    assert whole.finish_reason == "tool_calls"
    for call in whole.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert any("Paris" in c.function.arguments for c in whole.message.tool_calls)
    reply = claude.messages.create(
        model="smollm2", max_tokens=100, messages=QUESTION, tools=ANTHROPIC_TOOLS,
        tool_choice={"type": "any"}, stop_sequences=["Paris"], extra_body={"temperature": 0},
    )
    assert reply.stop_reason == "tool_use" and any(b.type == "tool_use" and b.input for b in reply.content)
    # A response format has no content to shape beside a forced call: accepted, as OpenAI's.
    formatted = client.chat.completions.create(**kwargs, response_format={"type": "json_object"}).choices[0]
    assert formatted.finish_reason == "tool_calls" and formatted.message.tool_calls


def test_pydantic_tools_with_nested_models_and_enums_are_forced_and_parsed(client: openai.OpenAI):
    # pydantic_function_tool writes nested models and enums as $defs references, strict.
    class Unit(str, enum.Enum):
        celsius = "celsius"
        fahrenheit = "fahrenheit"

    class Place(BaseModel):
        city: str

    class GetForecast(BaseModel):
        place: Place
        unit: Unit
        days: int

    tool = openai.pydantic_function_tool(GetForecast)
    assert "$defs" in tool["function"]["parameters"]
    kwargs = dict(model="smollm2", tools=[tool], temperature=0, max_tokens=60)
    messages = [{"role": "user", "content": "The forecast for Paris, 3 days, in celsius?"}]
    for choice in ("required", {"type": "function", "function": {"name": "GetForecast"}}):
        parsed = client.chat.completions.parse(messages=messages, tool_choice=choice, **kwargs).choices[0]
        assert parsed.finish_reason == "tool_calls"
        assert isinstance(parsed.message.tool_calls[0].function.parsed_arguments, GetForecast)


def test_a_forced_function_without_parameters_is_called_with_none(client: openai.OpenAI):
    # OpenAI: "omitting parameters defines a function with an empty parameter list".
    now = {"type": "function", "function": {"name": "now", "description": "The current time."}}
    messages = [{"role": "user", "content": "What time is it?"}]
    for choice in ("required", {"type": "function", "function": {"name": "now"}}):
        reply = client.chat.completions.create(
            model="smollm2", messages=messages, tools=[now], tool_choice=choice, temperature=1, seed=3,
            max_tokens=40,
        ).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in reply.message.tool_calls]
        assert calls[0] == ("now", "{}"), calls


def test_tool_choice_none_gives_text_without_tools_in_the_prompt(client: openai.OpenAI):
    kwargs = dict(model="smollm2", messages=QUESTION, temperature=0, max_tokens=12)
    plain = client.chat.completions.create(**kwargs)
    none = client.chat.completions.create(**kwargs, tools=TOOLS, tool_choice="none")
    auto = client.chat.completions.create(**{**kwargs, "max_tokens": 1}, tools=TOOLS)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens < auto.usage.prompt_tokens


def test_reasoning_content_split_whole_and_streamed(client: openai.OpenAI):
    # A grammar makes SmolLM2 write a <think> block; the server (--reasoning-parser think) splits it off.
    regex = r"<think>\nParis is in France\.\n</think>\n\n(Paris|Yes)\."
    kwargs = dict(
        model="smollm2", messages=QUESTION, temperature=0, max_tokens=40, extra_body={"guided_regex": regex}
    )
    message = client.chat.completions.create(**kwargs).choices[0].message
    assert message.reasoning_content == "Paris is in France."
    assert message.content in ("Paris.", "Yes.")
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
    assert (reasoning, content) == (message.reasoning_content, message.content)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
        ({"tools": [{"type": "function"}]}, "each tool"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        (
            {
                "tools": [
                    TIME,
                    {
                        "type": "function",
                        "function": {"name": "f", "parameters": {"properties": {"x": {"type": "frob"}}}},
                    },
                ],
                "tool_choice": "required",
            },
            "tools.1.function.parameters: the JSON schema does not compile",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            "parameters must be a JSON schema of type 'object'",
        ),
        ({"tools": [TIME, TIME]}, "tool names must be unique"),
        (
            {
                "tools": [TIME],
                "messages": [
                    *QUESTION,
                    {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                        "name": "get_time", "arguments": "{}"}}]},
                ],
            },
            "none answers c1",
        ),  # the conversation ends on a call without its result
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "frob"}},
                }
            },
            "response_format: the JSON schema does not compile",
        ),
    ],
)
def test_bad_tool_requests_are_400(server: LiveServer, extra, needle):
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 4, **extra}
    response = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


# ---- the same tools through Anthropic's Messages API and the Responses API ------------------------
ANTHROPIC_TOOLS = [
    {
        "name": t["function"]["name"],
        "description": t["function"]["description"],
        "input_schema": SCHEMAS[name],
    }
    for t in TOOLS
    for name in [t["function"]["name"]]
]
RESPONSES_TOOLS = [{"type": "function", **t["function"]} for t in TOOLS]


@pytest.fixture(scope="module")
def claude(server: LiveServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


def _tool_uses(content, names: set[str]) -> list[tuple[str, dict]]:
    uses = [b for b in content if b.type == "tool_use"]
    assert uses, content
    for block in uses:
        assert block.name in names and block.id.startswith("toolu_")
        jsonschema.validate(block.input, SCHEMAS[block.name])
    return [(b.name, b.input) for b in uses]


@pytest.mark.parametrize(
    "tool_choice, names",
    [({"type": "any"}, set(SCHEMAS)), ({"type": "tool", "name": "get_time"}, {"get_time"})],
)
def test_anthropic_forced_tool_use_whole_and_streamed(claude: anthropic.Anthropic, tool_choice, names):
    kwargs = dict(
        model="smollm2",
        max_tokens=80,
        messages=QUESTION,
        tools=ANTHROPIC_TOOLS,
        tool_choice=tool_choice,
        extra_body={"temperature": 0},
    )
    whole = claude.messages.create(**kwargs)
    assert whole.stop_reason == "tool_use"
    calls = _tool_uses(whole.content, names)
    with claude.messages.stream(**kwargs) as stream:
        final = stream.get_final_message()  # the SDK rebuilds each input from its input_json_delta events
    assert final.stop_reason == "tool_use" and _tool_uses(final.content, names) == calls
    # The tools are in the prompt as the chat route writes them, unless tool_choice is none.
    count = dict(model="smollm2", messages=QUESTION)
    plain = claude.messages.count_tokens(**count).input_tokens
    assert claude.messages.count_tokens(**count, tools=ANTHROPIC_TOOLS).input_tokens > plain
    none = claude.messages.count_tokens(**count, tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"})
    assert none.input_tokens == plain


@pytest.mark.parametrize(
    "tool_choice, names",
    [("required", set(SCHEMAS)), ({"type": "function", "name": "get_weather"}, {"get_weather"})],
)
def test_responses_forced_function_calls_whole_and_streamed(client: openai.OpenAI, tool_choice, names):
    kwargs = dict(
        model="smollm2",
        input=QUESTION[0]["content"],
        tools=RESPONSES_TOOLS,
        tool_choice=tool_choice,
        temperature=0,
        max_output_tokens=80,
    )
    whole = client.responses.create(**kwargs)
    calls = [item for item in whole.output if item.type == "function_call"]
    assert calls and whole.status == "completed"
    for call in calls:
        assert call.name in names and call.call_id
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    with client.responses.stream(**kwargs) as stream:
        final = stream.get_final_response()
    assert [(c.name, c.arguments) for c in final.output if c.type == "function_call"] == [
        (c.name, c.arguments) for c in calls
    ]
    assert (
        whole.usage.input_tokens
        > client.responses.create(**{**kwargs, "tools": None, "tool_choice": "auto"}).usage.input_tokens
    )


def test_responses_text_format_json_schema(client: openai.OpenAI, server: LiveServer):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "city", "strict": True, "schema": schema}
    kwargs = dict(
        model="smollm2", input="Name a city and its population.", temperature=0, max_output_tokens=60
    )
    reply = client.responses.create(**kwargs, text={"format": fmt})
    jsonschema.validate(json.loads(reply.output_text), schema)
    assert (
        json.loads(client.responses.create(**kwargs, text={"format": {"type": "json_object"}}).output_text)
        is not None
    )
    for bad in ({**fmt, "schema": {"type": "frobnicate"}}, {"type": "json_schema", "name": "x"}):
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**kwargs, text={"format": bad})
        assert e.value.body["param"].startswith("text.format")
    assert wait_for_idle(server)["mlx_infer_kv_blocks_used"] == 0


def test_smollm2_is_detected_from_its_gguf(smollm2_path: Path):
    from mlx_infer.loading.gguf_file import read_header
    from mlx_infer.tokenizer import Tokenizer
    from mlx_infer.tool_calls import model_parsers

    tokenizer = Tokenizer.from_gguf_metadata(read_header(smollm2_path).metadata)
    family, reasoning = model_parsers(tokenizer)
    assert (family.name, reasoning) == ("smollm2", None)
