"""Structured output in the engine, on a tiny random Llama over a byte-level vocabulary (no real weights).

A random model almost never writes valid JSON on its own, so every check here fails when the token mask
is not applied; free requests sharing the batch must give exactly the tokens of their solo runs.
"""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import make_tiny_llama
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

from mlx_infer.constraints import ConstraintSpec, compile_constraint
from mlx_infer.engine.engine import Engine, EngineConfig, check_block_accounting
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.errors import ConstraintFailed, InvalidRequest
from mlx_infer.sampling import SamplingParams
from mlx_infer.tokenizer import Tokenizer
from mlx_infer.tokenizer_gguf import bytes_to_unicode

VOCAB = 257  # 256 bytes and <eos>
PROMPTS = [list(b"Give me JSON: "), list(b"a b c d e f g h i j k"), list(b"xyz" * 7), list(b"{")]
SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "minItems": 1, "maxItems": 3},
        },
        "required": ["name", "age", "tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "point": {
                "type": "object",
                "properties": {
                    "x": {"type": "integer", "minimum": -9, "maximum": 9},
                    "ok": {"type": "boolean"},
                },
                "required": ["x", "ok"],
                "additionalProperties": False,
            },
            "code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]$"},
        },
        "required": ["point", "code"],
        "additionalProperties": False,
    },
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    alphabet = bytes_to_unicode()
    backend = Backend(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens(["<eos>"])
    return Tokenizer(backend, special_tokens={"eos_token": "<eos>"})


@pytest.fixture(scope="module")
def model():
    return make_tiny_llama(0, vocab_size=VOCAB)


def make_engine(model, tokenizer, num_blocks=256, block_size=4, budget=512) -> Engine:
    config = EngineConfig(
        block_size=block_size,
        num_blocks=num_blocks,
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=budget),
    )
    return Engine(model, tokenizer, 512, config)


def run_all(engine: Engine, requests: list[tuple[list[int], SamplingParams]]) -> list[list]:
    ids = [engine.add_request(p, params) for p, params in requests]
    outputs = {i: [] for i in ids}
    while engine.has_unfinished():
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [outputs[i] for i in ids]


def text_of(outputs) -> str:
    return "".join(o.text for o in outputs)


def tokens_of(outputs) -> list[int]:
    return [t for o in outputs for t in o.token_ids]


def params(constraint=None, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 80, "constraint": constraint, **kw})


def test_json_schemas_validate_greedy_and_sampled(model, tokenizer):
    engine = make_engine(model, tokenizer)
    requests = [
        (prompt, params(ConstraintSpec("json_schema", schema), temperature=temp, seed=seed))
        for schema in SCHEMAS
        for prompt in PROMPTS
        for temp, seed in ((0.0, None), (1.0, 7))
    ]
    for (_, p), outs in zip(requests, run_all(engine, requests)):
        assert outs[-1].finish_reason == "stop", text_of(outs)
        jsonschema.validate(json.loads(text_of(outs)), p.constraint.value)
    check_block_accounting(engine)


@pytest.mark.parametrize(
    "spec,pattern",
    [
        (ConstraintSpec("regex", r"[a-c]{2,4}-[0-9]{3}"), r"[a-c]{2,4}-[0-9]{3}"),
        (ConstraintSpec("choice", ["yes", "no", "it depends (really)"]), r"yes|no|it depends \(really\)"),
        (ConstraintSpec("lark", 'start: "<" NAME ">"\nNAME: /[a-z]{1,5}/\n'), r"<[a-z]{1,5}>"),
        (ConstraintSpec("gbnf", 'root ::= "(" [0-9] [0-9]? ")"'), r"\([0-9]{1,2}\)"),
    ],
    ids=["regex", "choice", "lark", "gbnf"],
)
def test_regex_choice_and_grammars_are_honoured(model, tokenizer, spec, pattern):
    engine = make_engine(model, tokenizer)
    requests = [(prompt, params(spec, temperature=1.0, seed=3)) for prompt in PROMPTS]
    for outs in run_all(engine, requests):
        assert outs[-1].finish_reason == "stop"
        assert re.fullmatch(pattern, text_of(outs)), text_of(outs)


def test_free_requests_equal_their_solo_runs_beside_constrained_ones(model, tokenizer):
    free = [params(max_tokens=24), params(max_tokens=24, temperature=1.0, seed=11)]
    solo = [
        tokens_of(run_all(make_engine(model, tokenizer), [(PROMPTS[i], p)])[0]) for i, p in enumerate(free)
    ]
    engine = make_engine(model, tokenizer)
    mixed = []
    for i in range(4):
        mixed.append((PROMPTS[i % 2], free[i % 2]))
        mixed.append((PROMPTS[(i + 1) % 4], params(ConstraintSpec("json_schema", SCHEMAS[i % 2]))))
    outs = run_all(engine, mixed)
    for i in range(4):
        assert tokens_of(outs[2 * i]) == solo[i % 2]
        jsonschema.validate(json.loads(text_of(outs[2 * i + 1])), SCHEMAS[i % 2])


def test_constraints_survive_preemption(model, tokenizer):
    # 28 blocks of 4 tokens for 8 sequences of ~75 tokens: the newest are preempted and recomputed.
    engine = make_engine(model, tokenizer, num_blocks=28, budget=32)
    spec = ConstraintSpec("json_schema", SCHEMAS[0])
    requests = [(PROMPTS[i % 4], params(spec, temperature=1.0, seed=i)) for i in range(8)]
    results = run_all(engine, requests)
    assert engine.scheduler.num_preemptions > 0
    for outs in results:
        jsonschema.validate(json.loads(text_of(outs)), SCHEMAS[0])
    # The same seeds alone, without preemption: the same answers.
    alone = run_all(make_engine(model, tokenizer), requests)
    assert [text_of(o) for o in results] == [text_of(o) for o in alone]
    check_block_accounting(engine)


def test_stop_strings_max_tokens_and_logprobs_with_a_constraint(model, tokenizer):
    engine = make_engine(model, tokenizer)
    spec = ConstraintSpec("json_schema", SCHEMAS[0])
    full, short, stopped = run_all(
        engine,
        [
            (PROMPTS[0], params(spec, logprobs=2)),
            (PROMPTS[0], params(spec, max_tokens=5)),
            (PROMPTS[0], params(spec, stop=['"age"'])),
        ],
    )
    text = text_of(full)
    assert all(o.logprobs and len(o.logprobs[0].top) == 2 for o in full)
    assert short[-1].finish_reason == "length" and text_of(short) == text[:5]
    assert stopped[-1].finish_reason == "stop" and text_of(stopped) == text[: text.index('"age"')]


def test_uncompilable_constraints_fail_before_anything_is_held(model, tokenizer):
    engine = make_engine(model, tokenizer)
    bad = [
        ConstraintSpec("json_schema", {"type": "object", "properties": {"a": {"type": "no-such-type"}}}),
        ConstraintSpec("regex", "(unclosed"),
        ConstraintSpec("lark", "start: undefined_rule\n"),
        ConstraintSpec("gbnf", "root ::= ("),
    ]
    for spec in bad:
        with pytest.raises(InvalidRequest, match="does not compile"):
            engine.add_request(PROMPTS[0], params(spec))
    assert not engine.requests and not engine.has_unfinished()
    assert engine.kv.pool.num_free == engine.kv.pool.num_blocks
    with pytest.raises(InvalidRequest):
        ConstraintSpec("choice", [])


def test_a_schema_no_output_satisfies_fails_its_request_as_the_requests_fault(model, tokenizer):
    # Compiles, but every object needs an object inside it: llguidance gives up while masking. The
    # request fails alone, as a 400 (ConstraintFailed), and its blocks go back.
    endless = {
        "$defs": {
            "A": {
                "type": "object",
                "properties": {"a": {"$ref": "#/$defs/A"}},
                "required": ["a"],
                "additionalProperties": False,
            }
        },
        "$ref": "#/$defs/A",
    }
    engine = make_engine(model, tokenizer)
    requests = [(PROMPTS[0], params(ConstraintSpec("json_schema", endless))), (PROMPTS[1], params())]
    bad, free = run_all(engine, requests)
    assert bad[-1].finish_reason == "error" and isinstance(bad[-1].error, ConstraintFailed)
    assert bad[-1].error.http_status == 400
    assert free[-1].finish_reason in ("stop", "length")
    check_block_accounting(engine)


def test_compiled_constraints_are_cached_by_spec(tokenizer):
    a = compile_constraint(ConstraintSpec("json_schema", {"type": "object", "required": ["x"]}), tokenizer)
    b = compile_constraint(ConstraintSpec("json_schema", '{"type": "object", "required": ["x"]}'), tokenizer)
    assert a is b


def test_objects_are_written_in_the_schemas_property_order(model, tokenizer):
    # As OpenAI's structured outputs: a "reasoning" property listed before the "answer" comes first.
    def schema(order):
        properties = {"reasoning": {"type": "string", "maxLength": 8}, "answer": {"type": "integer"}}
        return {
            "type": "object",
            "properties": {k: properties[k] for k in order},
            "required": list(order),
            "additionalProperties": False,
        }

    orders = [("reasoning", "answer"), ("answer", "reasoning")]
    engine = make_engine(model, tokenizer)
    requests = [(PROMPTS[0], params(ConstraintSpec("json_schema", schema(o)), temperature=0)) for o in orders]
    for order, outs in zip(orders, run_all(engine, requests)):
        assert tuple(json.loads(text_of(outs))) == order, text_of(outs)
