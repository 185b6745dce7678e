"""Tool-call parsers on captured outputs of each family, whole and streamed at every split point.

Tiny random models cannot produce real calls, so the outputs below are written as the families' models
write them (model cards, vendors' docs); each is parsed whole, then fed in two pieces split at every
character boundary and one character at a time: every way must reassemble to the whole-text parse.
"""

from __future__ import annotations

import json

import pytest

from mlx_infer.chat_template import render_chat
from mlx_infer.errors import InvalidRequest
from mlx_infer.tool_calls import (
    FAMILIES,
    OutputParser,
    ParsedOutput,
    ToolCallArgumentsDelta,
    ToolCallStart,
    ToolChoice,
    detect,
    forced_call_grammar,
    parse_output,
)
from mlx_infer.tool_calls.gemma3 import parse_calls
from mlx_infer.tool_calls.prompt import written_for_template

TOOLS = [
    "get_weather",
    "get_time",
    "get_current_temperature",
    "get_temperature_date",
    "get_current_conditions",
]
PARIS = {"city": "Paris"}

# (family, captured output, expected content, expected [(name, arguments object)])
CASES = [
    # Qwen2.5's function-calling guide, two parallel calls.
    (
        "hermes",
        '<tool_call>\n{"name": "get_current_temperature", "arguments": '
        '{"location": "San Francisco, CA, USA", "unit": "celsius"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_temperature_date", "arguments": '
        '{"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"}}\n</tool_call>',
        "",
        [
            ("get_current_temperature", {"location": "San Francisco, CA, USA", "unit": "celsius"}),
            (
                "get_temperature_date",
                {"location": "San Francisco, CA, USA", "date": "2024-10-01", "unit": "celsius"},
            ),
        ],
    ),
    # Text before the call, braces and escaped quotes inside strings, keys in the other order.
    (
        "hermes",
        'Let me look that up.\n<tool_call>\n{"arguments": {"city": "Par}is \\"{x\\"", "days": [1, 2]}, '
        '"name": "get_weather"}\n</tool_call>',
        "Let me look that up.",
        [("get_weather", {"city": 'Par}is "{x"', "days": [1, 2]})],
    ),
    # Arguments sent as a JSON string, and a call without arguments.
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time"}\n</tool_call>',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    # Plain answers: a lone '<', an unfinished marker, no call at all.
    ("hermes", "If a < b then <tool is not a call.", "If a < b then <tool is not a call.", []),
    ("hermes", "<tool_call>\nnot json\n</tool_call> ok", "<tool_call>\nnot json\n</tool_call> ok", []),
    # SmolLM2's list in one block.
    (
        "smollm2",
        '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, '
        '{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]</tool_call>',
        "",
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris"})],
    ),
    # "No call needed", as SmolLM2's prompt asks it to say: an empty block is neither call nor text.
    ("smollm2", "<tool_call>[]</tool_call>", "", []),
    # Llama 3.1: bare JSON as the answer; with <|python_tag|>; 3.2's several calls with ';'.
    (
        "llama3_json",
        '{"name": "get_current_conditions", "parameters": '
        '{"location": "San Francisco, CA", "unit": "Fahrenheit"}}',
        "",
        [("get_current_conditions", {"location": "San Francisco, CA", "unit": "Fahrenheit"})],
    ),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}',
        "",
        [("get_weather", PARIS)],
    ),
    (
        "llama3_json",
        '\n{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": "get_time", "parameters": {}}',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    # JSON the user asked for is no call: its name is no tool.
    ("llama3_json", '{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    # Mistral v3 tokenizers, then v11's name[ARGS] form.
    (
        "mistral",
        '[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Paris, France", '
        '"format": "celsius"}}]',
        "",
        [("get_current_weather", {"location": "Paris, France", "format": "celsius"})],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{}',
        "Sure.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    # Gemma 3: Python-style list, a tool_code fence, and a list that is no call.
    (
        "gemma3",
        '[get_weather(city="Paris"), get_time(timezone="Europe/Paris", utc=true)]',
        "",
        [("get_weather", PARIS), ("get_time", {"timezone": "Europe/Paris", "utc": True})],
    ),
    (
        "gemma3",
        "I will check.\n```tool_code\nprint(get_weather(city='Paris', days=[1, 2]))\n```",
        "I will check.\n",
        [("get_weather", {"city": "Paris", "days": [1, 2]})],
    ),
    ("gemma3", "[1, 2, 3] are numbers.", "[1, 2, 3] are numbers.", []),
    # The generic fallback: bare JSON, a list, a ```json fence, and JSON that names no tool.
    ("generic", '{"name": "get_weather", "arguments": {"city": "Paris"}}', "", [("get_weather", PARIS)]),
    (
        "generic",
        '[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]',
        "",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "generic",
        'Calling:\n```json\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n```',
        "Calling:",
        [("get_weather", PARIS)],
    ),
    ("generic", '```json\n{"name": "Bob"}\n```', '```json\n{"name": "Bob"}\n```', []),
    # GLM-4.5 / 4.6: key/value pairs, JSON values read as JSON, others as strings; 4.7 without newlines.
    (
        "glm45",
        "I will check both.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris, <b>FR</b>"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>\n"
        "<tool_call>get_time\n</tool_call>",
        "I will check both.",
        [("get_weather", {"city": "Paris, <b>FR</b>", "days": [1, 2]}), ("get_time", {})],
    ),
    (
        "glm45",
        "<tool_call>\nget_weather<arg_key>city</arg_key><arg_value>Paris</arg_value>"
        '<arg_key>opts</arg_key><arg_value>{"utc": true}</arg_value></tool_call>',
        "",
        [("get_weather", {"city": "Paris", "opts": {"utc": True}})],
    ),
    # A Hermes-style JSON block is no GLM call: text.
    (
        "glm45",
        'x <tool_call>{"name": "get_weather"}</tool_call>',
        'x <tool_call>{"name": "get_weather"}</tool_call>',
        [],
    ),
    # DeepSeek V3 / R1: "function<｜tool▁sep｜>NAME" and a ```json fence, several calls in one region.
    (
        "deepseek_v3",
        "Let me see.\n\n<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Pa```ris"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>'
        "get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Let me see.",
        [("get_weather", {"city": "Pa```ris"}), ("get_time", {})],
    ),
    # A call without its separator is malformed: the region is text.
    (
        "deepseek_v3",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁call▁end｜>",
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁call▁end｜>",
        [],
    ),
    # DeepSeek V3.1: "NAME<｜tool▁sep｜>ARGS".
    (
        "deepseek_v31",
        "Sure.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Paris", "days": [1, 2]}<｜tool▁call▁end｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}'
        "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "Sure.",
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {})],
    ),
    ("deepseek_v31", "No <｜tool▁sep｜> here.", "No <｜tool▁sep｜> here.", []),
    # Text after a region marker that holds no call: all of it is text, spacing kept.
    (
        "kimi_k2",
        "Hi \n<|tool_calls_section_begin|> not a call",
        "Hi \n<|tool_calls_section_begin|> not a call",
        [],
    ),
    # Kimi K2: functions.NAME:IDX heads.
    (
        "kimi_k2",
        "Checking. <|tool_calls_section_begin|> <|tool_call_begin|> functions.get_weather:0 "
        '<|tool_call_argument_begin|> {"city": "Paris"} <|tool_call_end|> <|tool_call_begin|>'
        "functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "Checking.",
        [("get_weather", PARIS), ("get_time", {})],
    ),
    (
        "kimi_k2",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_end|>"
        "<|tool_calls_section_end|> done",
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_end|>"
        "<|tool_calls_section_end|> done",
        [],
    ),
]


def _stripped(parsed: ParsedOutput) -> tuple:
    """The parse without call ids (random per call)."""
    return parsed.reasoning, parsed.content, [(c.name, c.arguments) for c in parsed.tool_calls]


def _streamed(text: str, pieces: list[str], **kwargs) -> ParsedOutput:
    parser = OutputParser(**kwargs)
    events = []
    for piece in pieces:
        events += parser.feed(piece)
    events += parser.finish()
    # OpenAI's order: a call's start (id, name) comes before any of its argument fragments.
    started = set()
    for e in events:
        if isinstance(e, ToolCallStart):
            started.add(e.index)
        elif isinstance(e, ToolCallArgumentsDelta):
            assert e.index in started
    return parser.result


def _check_every_split(text: str, **kwargs) -> ParsedOutput:
    whole = parse_output(text, **kwargs)
    for k in range(len(text) + 1):
        assert _stripped(_streamed(text, [text[:k], text[k:]], **kwargs)) == _stripped(whole), k
    assert _stripped(_streamed(text, list(text), **kwargs)) == _stripped(whole)
    return whole


@pytest.mark.parametrize("family, text, content, calls", CASES)
def test_family_parses_captured_output_whole_and_streamed(family, text, content, calls):
    parsed = _check_every_split(text, family=FAMILIES[family], tool_names=TOOLS)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    assert len({c.id for c in parsed.tool_calls}) == len(calls)


def test_arguments_stream_as_they_arrive():
    parser = OutputParser(family=FAMILIES["hermes"], tool_names=TOOLS)
    events = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert [type(e) for e in events] == [ToolCallStart, ToolCallArgumentsDelta]
    assert events[0].name == "get_weather" and events[1].arguments == '{"city": "Pa'
    assert parser.feed('ris"}}\n</tool_call>') == [ToolCallArgumentsDelta(0, 'ris"}')]


def test_truncated_call_keeps_what_arrived():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    parsed = _check_every_split(text, family=FAMILIES["hermes"], tool_names=TOOLS)
    assert _stripped(parsed) == ("", "", [("get_weather", '{"city": "Par')])


@pytest.mark.parametrize("forced", [False, True])
def test_call_cut_before_its_name_is_markup_only_when_not_forced(forced: bool):
    """max_tokens can end an answer inside a call's marker, before its name: a free answer shows what
    came, a forced one (a grammar allows calls only) drops the unparsed markup rather than return it
    as content."""
    text = '<tool_call>[{"name": "get_'
    for cut in range(len(text) + 1):
        parser = OutputParser(family=FAMILIES["smollm2"], tool_names=TOOLS, forced=forced)
        parser.feed(text[:cut]), parser.feed(text[cut:]), parser.finish()
        assert parser.result.content == ("" if forced else text) and parser.result.tool_calls == []


def test_parallel_false_keeps_the_first_call():
    text = CASES[0][1]
    parsed = _check_every_split(text, family=FAMILIES["hermes"], tool_names=TOOLS, parallel=False)
    assert [c.name for c in parsed.tool_calls] == ["get_current_temperature"]


def test_reasoning_then_call():
    text = (
        "<think>\nThe user wants the weather in Paris; I should call get_weather.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    )
    parsed = _check_every_split(text, family=FAMILIES["hermes"], tool_names=TOOLS, reasoning="think")
    assert parsed.reasoning == "The user wants the weather in Paris; I should call get_weather."
    assert _stripped(parsed)[1:] == ("", [("get_weather", '{"city": "Paris"}')])


def test_no_family_means_plain_text():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    assert _stripped(_check_every_split(text)) == ("", text, [])


QWEN_TEMPLATE_PART = "{%- if tools %}<tools>{{ tools }}</tools>{% endif %}<tool_call>"
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>"
    "system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    "template, tokens, family",
    [
        (QWEN_TEMPLATE_PART, (), "hermes"),
        ("{{ '[AVAILABLE_TOOLS]' }}{{ '[TOOL_CALLS]' }}", (), "mistral"),
        ("{{ '[INST]' }}", ("[TOOL_CALLS]",), "mistral"),
        ("<|start_header_id|>ipython<|end_header_id|>{{ '<|python_tag|>' }}", (), "llama3_json"),
        ("<|start_header_id|>", ("<|python_tag|>",), "llama3_json"),
        ("{{ '<start_of_turn>' + role }}", (), "gemma3"),
        (SMOLLM2_TEMPLATE, (), "smollm2"),
        ("{{ messages }}", (), "generic"),
        # GLM-4.5's template (it also has <tool_call>, which alone means Hermes).
        ("<tool_call>{{ tc.name }}\n<arg_key>{{ k }}</arg_key>\n<arg_value>", (), "glm45"),
        ("{{ '<|user|>' }}", ("<arg_key>",), "glm45"),
        (
            "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + "
            "'\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```'}}",
            (),
            "deepseek_v3",
        ),
        (
            "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
            "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
            (),
            "deepseek_v31",
        ),
        ("{{ '<|tool_calls_section_begin|>' }}", (), "kimi_k2"),
        ("{{ '<|im_user|>' }}", ("<|tool_calls_section_begin|>",), "kimi_k2"),
    ],
)
def test_detect_family_from_template_and_tokens(template, tokens, family):
    assert detect(template, lambda t: t in tokens).name == family


def test_smollm2_template_gets_tools_calls_and_results_written_in():
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "18 C"},
    ]
    written = written_for_template(FAMILIES["smollm2"], SMOLLM2_TEMPLATE, messages, tools)
    prompt = render_chat(SMOLLM2_TEMPLATE, written, special_tokens={})
    assert prompt.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert '<tools>[{"type": "function", "function": {"name": "get_weather"' in prompt
    assert (
        '<|im_start|>assistant\n<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}]'
        in prompt
    )
    assert "<|im_start|>user\n<tool_response>\n18 C\n</tool_response><|im_end|>" in prompt


def test_template_sees_call_arguments_as_an_object():
    template = (
        "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments | tojson }}"
        "{% endfor %}{% endfor %}"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert (
        render_chat(template, [{"role": "assistant", "tool_calls": [call]}], special_tokens={}) == '{"a": 1}'
    )


@pytest.mark.parametrize(
    "value, expected",
    [
        (None, ToolChoice("auto")),
        ("none", ToolChoice("none")),
        ("required", ToolChoice("required")),
        ({"type": "function", "function": {"name": "f"}}, ToolChoice("required", "f")),
    ],
)
def test_tool_choice_forms(value, expected):
    assert ToolChoice.parse(value) == expected


@pytest.mark.parametrize("value", ["sometimes", {"type": "function"}, 3])
def test_bad_tool_choice_is_a_clear_error(value):
    with pytest.raises(InvalidRequest, match="tool_choice"):
        ToolChoice.parse(value)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
            "required": ["city"],
        },
    },
}


def test_forced_grammar_names_only_the_chosen_function():
    other = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
    grammar = forced_call_grammar(FAMILIES["hermes"], [WEATHER_TOOL, other], name="get_time")
    assert '"const": "get_time"' in grammar and "get_weather" not in grammar
    with pytest.raises(InvalidRequest, match="not among the tools"):
        forced_call_grammar(FAMILIES["hermes"], [WEATHER_TOOL], name="nope")


def test_gemma_call_rule_orders_required_then_optional():
    rule = FAMILIES["gemma3"].call_rule("get_weather", WEATHER_TOOL["function"]["parameters"])
    assert rule.startswith('"get_weather(" "city=" %json{"x-guidance"')
    assert ', "type": "string"} (", " ("unit=" %json{' in rule


def test_gemma_parse_calls_reads_literals_only():
    assert parse_calls('[f(a="x", b=null, c={"k": [1, 2.5]})]') == [
        ("f", {"a": "x", "b": None, "c": {"k": [1, 2.5]}})
    ]
    assert parse_calls("f(x)") is None  # positional arguments name nothing
    assert parse_calls("f(a=__import__('os'))") is None  # never evaluated


def _byte_matcher(grammar: str):
    """An llguidance matcher over a byte-level vocabulary (one token per byte), to try texts on a grammar."""
    import llguidance
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    ll = llguidance.LLTokenizer(
        tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[tok.token_to_id("</s>")]
    )
    matcher = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return lambda text: matcher.consume_tokens(tok.encode(text).ids) and matcher.is_accepting()


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forced_grammar_admits_the_family_call_and_its_parser_reads_it(family):
    tool = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {**WEATHER_TOOL["function"]["parameters"]}},
    }
    tool["function"]["parameters"]["properties"] = {
        **tool["function"]["parameters"]["properties"],
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 2},
    }
    grammar = forced_call_grammar(FAMILIES[family], [tool])
    arguments = {"city": "Paris", "unit": "C", "days": 3, "tags": ["a", "b"]}
    text = FAMILIES[family].render_calls([("get_weather", arguments)])
    assert _byte_matcher(grammar)(text), text
    assert not _byte_matcher(grammar)(FAMILIES[family].render_calls([("get_weather", {"city": 3})]))
    parsed = _check_every_split(text, family=FAMILIES[family], tool_names=["get_weather"])
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", arguments)]
    assert parsed.content == ""


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_forced_grammar_resolves_the_references_pydantic_writes(family):
    # pydantic_function_tool puts nested models and enums in $defs, a recursive model refers to one by
    # itself: each reference must resolve where the family's grammar places the parameters.
    parameters = {
        "$defs": {
            "Unit": {"type": "string", "enum": ["C", "F"]},
            "Place": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
                },
                "required": ["city", "near"],
                "additionalProperties": False,
            },
        },
        "type": "object",
        "properties": {"place": {"$ref": "#/$defs/Place"}, "unit": {"$ref": "#/$defs/Unit"}},
        "required": ["place", "unit"],
        "additionalProperties": False,
    }
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": parameters}}
    grammar = forced_call_grammar(FAMILIES[family], [tool])
    accepts = lambda arguments: _byte_matcher(grammar)(  # noqa: E731
        FAMILIES[family].render_calls([("get_weather", arguments)])
    )
    near = {"city": "Paris", "near": {"city": "Versailles", "near": None}}
    assert accepts({"place": near, "unit": "C"})
    assert not accepts({"place": near, "unit": "K"})  # not in the referenced enum
    assert not accepts({"place": {"city": "Paris", "near": {"city": 3, "near": None}}, "unit": "C"})


class _TextTokenizer:
    """Token ids are characters: enough of a tokenizer for a ChatPlan's parser."""

    def decode(self, ids):
        return "".join(map(chr, ids))


@pytest.mark.parametrize("forced", [None, "a grammar"])
def test_prompt_opened_think_block_unless_a_call_is_forced(forced):
    from mlx_infer.tool_calls import ChatPlan

    plan = ChatPlan(_TextTokenizer(), FAMILIES["hermes"], [WEATHER_TOOL], "think", True, forced, {})
    parser = plan.parser([ord(c) for c in "<|im_start|>assistant\n<think>\n"])
    text = 'The call:<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>'
    parser.feed(text)
    parser.finish()
    if forced is None:  # still thinking: all of it is reasoning
        assert _stripped(parser.result) == (text, "", [])
    else:  # not reasoning; and a forced answer is calls only (text there is cut-off markup: dropped)
        assert _stripped(parser.result) == ("", "", [("get_weather", "{}")])


NEW_FAMILIES = ("glm45", "deepseek_v3", "deepseek_v31", "kimi_k2")


@pytest.mark.parametrize("case", [c for c in CASES if c[0] in NEW_FAMILIES], ids=lambda c: c[0])
def test_marked_families_equal_in_random_small_deltas(case):
    import random

    family, text, content, calls = case
    whole = parse_output(text, family=FAMILIES[family], tool_names=TOOLS)
    rng = random.Random(len(text))
    for _ in range(50):
        pieces, i = [], 0
        while i < len(text):
            n = rng.randint(1, 6)
            pieces.append(text[i : i + n])
            i += n
        streamed = _streamed(text, pieces, family=FAMILIES[family], tool_names=TOOLS)
        assert _stripped(streamed) == _stripped(whole)


def test_kimi_call_ids_are_the_models_own():
    text = next(c[1] for c in CASES if c[0] == "kimi_k2" and c[3])
    parsed = parse_output(text, family=FAMILIES["kimi_k2"], tool_names=TOOLS)
    assert [c.id for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_marked_family_truncated_call_keeps_what_arrived(family):
    text = FAMILIES[family].render_calls([("get_weather", {"city": "Paris", "days": 3})])
    cut = text[: text.index("3") + 1]
    parsed = _check_every_split(cut, family=FAMILIES[family], tool_names=TOOLS)
    assert [c.name for c in parsed.tool_calls] == ["get_weather"]
    assert parsed.content == ""


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_marked_family_reasoning_then_call(family):
    call = FAMILIES[family].render_calls([("get_weather", PARIS)])
    text = f"<think>\nNeed the weather.\n</think>\n\n{call}"
    parsed = _check_every_split(text, family=FAMILIES[family], tool_names=TOOLS, reasoning="think")
    assert _stripped(parsed) == ("Need the weather.", "", [("get_weather", '{"city": "Paris"}')])


# How each family's own chat template writes past calls (the call-rendering part of the real templates).
HISTORY_TEMPLATES = {
    "glm45": (
        "{% for m in messages %}{% for tc in m.tool_calls or [] %}{% set tc = tc.function %}"
        "{{ '\\n<tool_call>' + tc.name }}\n{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
        "<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}</arg_value>\n{% endfor %}"
        "</tool_call>{% endfor %}{% endfor %}"
    ),
    "deepseek_v3": (
        "{% for m in messages %}{{'<｜tool▁calls▁begin｜>'}}{% for tool in m.tool_calls or [] %}"
        "{{'<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + "
        "'```json' + '\\n' + tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}"
        "{% endfor %}{{'<｜tool▁calls▁end｜>'}}{% endfor %}"
    ),
    "deepseek_v31": (
        "{% for m in messages %}{{'<｜tool▁calls▁begin｜>'}}{% for tool in m.tool_calls or [] %}"
        "{{'<｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
        "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}{% endfor %}"
        "{{'<｜tool▁calls▁end｜>'}}{% endfor %}"
    ),
    "kimi_k2": (
        "{% for m in messages %}<|tool_calls_section_begin|>{% for tool_call in m.tool_calls or [] %}"
        "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>"
        "{% if tool_call['function']['arguments'] is string %}{{ tool_call['function']['arguments'] }}"
        "{% else %}{{ tool_call['function']['arguments'] | tojson }}{% endif %}<|tool_call_end|>"
        "{% endfor %}<|tool_calls_section_end|>{% endfor %}"
    ),
}


@pytest.mark.parametrize("family", sorted(HISTORY_TEMPLATES))
def test_past_calls_round_trip_through_the_family_template(family):
    """A parsed answer sent back as history renders as the model wrote it, and parses back the same."""
    text = FAMILIES[family].render_calls(
        [("get_weather", {"city": "Paris", "days": [1, 2]}), ("get_time", {"utc": True})]
    )
    parsed = parse_output(text, family=FAMILIES[family], tool_names=TOOLS)
    calls = [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in parsed.tool_calls
    ]
    rendered = render_chat(
        HISTORY_TEMPLATES[family], [{"role": "assistant", "tool_calls": calls}], special_tokens={}
    )
    again = parse_output(rendered, family=FAMILIES[family], tool_names=TOOLS)
    assert _stripped(again) == _stripped(parsed)
    assert [(c.name, json.loads(c.arguments)) for c in again.tool_calls] == [
        ("get_weather", {"city": "Paris", "days": [1, 2]}),
        ("get_time", {"utc": True}),
    ]


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_forced_grammar_names_markers_inside_calls_by_token_id(family):
    fam = FAMILIES[family]
    markers = [*fam.starts, *([fam.end] if fam.end else []), *fam.markers]
    special = {m: 200 + i for i, m in enumerate(dict.fromkeys(markers))}
    grammar = forced_call_grammar(fam, [WEATHER_TOOL], special=special)
    for marker in fam.markers:
        assert f"<[{special[marker]}]>" in grammar, marker
        assert json.dumps(marker, ensure_ascii=False) not in grammar
    _byte_matcher(grammar)  # llguidance accepts it


# GLM writes strings bare and other values as JSON; its parsers type each value by the request's schema.
LOOKUP_TOOL = {
    "type": "function",
    "function": {
        "name": "lookup",
        "parameters": {
            "type": "object",
            "properties": {
                "zip": {"type": "string"}, "code": {"type": "string"}, "flag": {"type": "string"},
                "note": {"type": "string"}, "count": {"type": "integer"}, "ratio": {"type": "number"},
                "strict": {"type": "boolean"}, "tags": {"type": "array"}, "where": {"type": "object"},
            },
        },
    },
}
GLM_LOOKUP = (
    "<tool_call>lookup\n"
    "<arg_key>zip</arg_key>\n<arg_value>02139</arg_value>\n"
    "<arg_key>code</arg_key>\n<arg_value>123</arg_value>\n"
    "<arg_key>flag</arg_key>\n<arg_value>true</arg_value>\n"
    '<arg_key>note</arg_key>\n<arg_value>"quoted"</arg_value>\n'
    "<arg_key>count</arg_key>\n<arg_value>3</arg_value>\n"
    "<arg_key>ratio</arg_key>\n<arg_value>0.5</arg_value>\n"
    "<arg_key>strict</arg_key>\n<arg_value>false</arg_value>\n"
    '<arg_key>tags</arg_key>\n<arg_value>["a", 1]</arg_value>\n'
    '<arg_key>where</arg_key>\n<arg_value>{"x": null}</arg_value>\n'
    "<arg_key>extra</arg_key>\n<arg_value>7</arg_value>\n"
    "</tool_call>"
)
LOOKUP_TYPED = {
    "zip": "02139", "code": "123", "flag": "true", "note": "quoted", "count": 3, "ratio": 0.5,
    "strict": False, "tags": ["a", 1], "where": {"x": None}, "extra": 7,
}


def test_glm45_values_typed_by_the_tools_schema_whole_and_streamed():
    """A string parameter keeps numeric or boolean-looking text as a string; typed ones parse as JSON; a
    key the schema does not declare parses as JSON (vLLM's glm4_moe parser does the same)."""
    import random

    parameters = {"lookup": LOOKUP_TOOL["function"]["parameters"]}
    kwargs = dict(family=FAMILIES["glm45"], tool_names=["lookup"], parameters=parameters)
    parsed = _check_every_split(GLM_LOOKUP, **kwargs)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("lookup", LOOKUP_TYPED)]
    rng = random.Random(0)
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(GLM_LOOKUP)), 12))
        pieces = [GLM_LOOKUP[a:b] for a, b in zip([0, *cuts], [*cuts, len(GLM_LOOKUP)])]
        assert _stripped(_streamed(GLM_LOOKUP, pieces, **kwargs)) == _stripped(parsed)
    # Without the schema every value that parses as JSON is JSON.
    untyped = json.loads(parse_output(GLM_LOOKUP, family=FAMILIES["glm45"], tool_names=["lookup"])
                         .tool_calls[0].arguments)
    assert (untyped["code"], untyped["flag"], untyped["zip"]) == (123, True, "02139")


def test_glm45_chat_plan_hands_the_request_tools_to_the_parser():
    from mlx_infer.tool_calls import ChatPlan

    plan = ChatPlan(_TextTokenizer(), FAMILIES["glm45"], [LOOKUP_TOOL], None, True, None, {})
    parser = plan.parser()
    events = [e for piece in (GLM_LOOKUP[:40], GLM_LOOKUP[40:]) for e in parser.feed(piece)]
    events += parser.finish()
    streamed = "".join(e.arguments for e in events if isinstance(e, ToolCallArgumentsDelta))
    assert json.loads(streamed) == LOOKUP_TYPED == json.loads(parser.result.tool_calls[0].arguments)
