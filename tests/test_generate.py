"""`mlx-infer generate` end to end on the real SmolLM2 GGUF: greedy output against transformers, the CLI."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pexpect
import pytest

from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.errors import ContextTooLong
from mlx_infer.loading import load
from mlx_infer.sampling import SamplingParams

REFERENCES = json.loads((Path(__file__).parent / "oracle" / "smollm2_references.json").read_text())
CLI = [sys.executable, "-m", "mlx_infer.cli"]


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    return load(str(smollm2_path))


def test_greedy_matches_transformers_in_one_batch(smollm2):
    """Every reference prompt (English, code, German, French, Russian, Chinese, Japanese, digits,
    multi-turn), all decoded together in one continuous batch, equals transformers' float32 greedy
    output on the same GGUF weights."""
    generations = REFERENCES["generations"]
    assert len(generations) >= 6
    engine = Engine(smollm2.model, smollm2.tokenizer, smollm2.max_context, EngineConfig(kv_memory=0.25))
    ids = {}
    for g in generations:
        assert smollm2.tokenizer.encode_chat(g["messages"]) == g["prompt_ids"]
        params = SamplingParams(max_tokens=REFERENCES["max_new_tokens"])
        ids[engine.add_request(g["prompt_ids"], params)] = g
    got = {rid: [] for rid in ids}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].extend(out.token_ids)
    for rid, g in ids.items():
        assert got[rid] == g["output_ids"], g["name"]


def _run(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, input=input_text, env=env, timeout=300
    )


def test_one_shot_prints_the_answer(smollm2_path):
    result = _run("generate", "-m", str(smollm2_path), "-p", "What is the capital of France?", "--verbose")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France is Paris."
    assert "tok/s" in result.stderr and "TTFT" in result.stderr


def test_piped_chat_writes_only_the_answers_to_stdout(smollm2_path):
    """Scripted input (no terminal): the help, the prompts and the stats go to stderr, as with -p."""
    questions = "What is the capital of France?\n/stats\nWhat is the capital of France?\n"
    result = _run("generate", "-m", str(smollm2_path), "--temp", "0", input_text=questions)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["The capital of France is Paris."] * 2
    assert result.stderr.count("finish: stop") == 1 and "(stats line off)" in result.stderr
    assert ">>> " in result.stderr and "/reset" in result.stderr


def test_piped_bytes_that_are_not_utf8_are_refused_a_line_at_a_time(smollm2_path):
    piped = b"/system caf\xe9\nHi \xff\nWhat is the capital of France?\n"  # as a Latin-1 file holds them
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LC_ALL": "C"}  # stdin decoded with surrogateescape
    result = subprocess.run(
        [*CLI, "generate", "-m", str(smollm2_path), "--temp", "0"], capture_output=True, input=piped, env=env
    )
    stderr = result.stderr.decode()
    # The chat went on past the refused turn; the exit status tells a script one failed (bad input: 2).
    assert result.returncode == 2 and "Traceback" not in stderr, stderr
    assert "the system prompt is not valid UTF-8 text: the byte 0xe9 at character 3" in stderr
    assert "the message is not valid UTF-8 text: the byte 0xff at character 3" in stderr
    assert result.stdout.decode().splitlines() == ["The capital of France is Paris."]


def test_prompt_from_stdin_and_stop_string(smollm2_path):
    result = _run(
        "generate",
        "-m",
        str(smollm2_path),
        "-p",
        "-",
        "--stop",
        " is",
        input_text="What is the capital of France?\n",  # as echo pipes it: the line end is not the prompt's
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "The capital of France"


@pytest.mark.parametrize(
    "args,message",
    [
        (["generate", "-m", "/nonexistent/model.gguf", "-p", "hi"], "no such file or folder"),
        (["generate", "-m", "{model}", "-p", "hi", "--top-p", "0"], "--top-p must be in (0, 1]"),
        (["generate", "-m", "{model}", "-p", "hi", "--temp", "nan"], "--temp must be in [0, 100]"),
        (["generate", "-m", "{model}", "-p", "-"], "nothing was piped in"),  # stdin is empty
        (["generate", "-m", "{model}", "-p", "hi", "--tools", "/nonexistent/tools.json"], "cannot read"),
        (["generate", "-m", "{model}", "-p", "hi", "--kv-memory", "100000"], "more than this machine"),
        (["generate", "-m", "{model}", "-p", "hi", "--kv-memory", "nan"], "--kv-memory must be positive"),
        (["generate", "-m", "{model}", "-p", "hi", "--json"], "unrecognized arguments: --json"),
        (["generate", "-m", "{model}", "-p", "hi", "--system", "x", "--no-chat-template"], "--system needs"),
        # bytes that are not UTF-8 (Python's surrogateescape spells the byte 0xff as U+DCFF in argv)
        (["generate", "-m", "{model}", "-p", "Hi \udcff"], "not valid UTF-8 text: the byte 0xff"),
        (["generate", "-m", "{model}", "-p", "hi", "--system", "caf\udce9"], "--system is not valid UTF-8"),
        (["serve", "-m", "{model}", "--port", "70000"], "a port is 0 to 65535"),
        (["serve", "-m", "{model}", "--host", "999.1.1.1"], "cannot listen on 999.1.1.1:8080"),
        (["launch", "--hosts", "127.0.0.1", "--port", "0", "--", "generate"], "a port is 1 to 65535"),
    ],
)
def test_bad_input_is_one_line_and_nonzero(smollm2_path, args, message):
    result = _run(*[a.format(model=smollm2_path) for a in args], input_text="")
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert "Traceback" not in result.stderr


def test_a_reader_that_goes_away_stops_generate_quietly(smollm2_path):
    """`generate ... | head -c 5`: the broken pipe ends it as it ends a Unix filter (141, no error)."""
    command = [*CLI, "generate", "-m", str(smollm2_path), "-p", "Count to 50."]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env) as process:
        assert process.stdout.read(3)
        process.stdout.close()
        stderr = process.stderr.read().decode()
        assert process.wait(timeout=120) == 141
    assert "error" not in stderr and "Traceback" not in stderr, stderr


@pytest.mark.parametrize("command", ["chat", "models"])
def test_a_reader_gone_before_the_first_line_is_141_for_rich_output_too(smollm2_path, tmp_path, command):
    """Output printed through rich (the piped chat's answers, the models table) ends as a filter's too,
    where rich itself would exit 1."""
    args = ["generate", "-m", str(smollm2_path)] if command == "chat" else ["models", "--dir", str(tmp_path)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with subprocess.Popen(
        [*CLI, *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env
    ) as process:
        process.stdout.close()  # the reader is gone before anything is written
        _, stderr = process.communicate(b"Count to 50.\n", timeout=120)
        assert process.returncode == 141, stderr.decode()
    assert b"Traceback" not in stderr and b"error" not in stderr, stderr.decode()


def test_too_long_prompt_names_both_numbers(smollm2):
    engine = Engine(smollm2.model, smollm2.tokenizer, smollm2.max_context, EngineConfig(kv_memory=0.05))
    with pytest.raises(ContextTooLong, match=r"the prompt has 8200 tokens but the context holds 8192"):
        engine.add_request([1] * 8200, SamplingParams(max_tokens=1))
    # max_tokens beyond the room left is a cap, not an error: the answer would stop at the edge.
    engine.abort(engine.add_request([1, 2, 3], SamplingParams(max_tokens=9000)))


def test_answer_stops_with_length_when_the_context_is_full(smollm2_path):
    result = _run(
        "generate", "-m", str(smollm2_path), "-p", "Tell me a long story.", "--max-context", "64",
        "--max-tokens", "500", "--verbose",
    )
    assert result.returncode == 0, result.stderr
    assert "finish: length (context of 64 tokens full)" in result.stderr, result.stderr
    stats = re.search(r"prompt: (\d+) tokens.*generation: (\d+) tokens", result.stderr)
    assert int(stats.group(1)) + int(stats.group(2)) == 64, result.stderr


def test_interactive_chat_two_turns_and_reset(smollm2_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb", "COLUMNS": "200"}
    child = pexpect.spawn(
        CLI[0],
        [*CLI[1:], "generate", "-m", str(smollm2_path), "--max-tokens", "24"],
        env=env,
        encoding="utf-8",
        timeout=180,
    )
    try:
        child.expect(">>> ")
        child.sendline("What is the capital of France?")
        child.expect("Paris")
        child.expect(r"generation: \d+ tokens")
        child.expect(">>> ")
        child.sendline("And of Germany?")
        child.expect(r"prompt: (\d+) tokens \((\d+) cached\)")
        prompt_tokens, cached = int(child.match.group(1)), int(child.match.group(2))
        # The second turn reuses the first turn's KV blocks: all but the new message and a partial block.
        assert cached >= prompt_tokens - 16 - 12, (prompt_tokens, cached)
        child.expect(">>> ")
        child.sendline("/reset")
        child.expect("conversation cleared")
        child.expect(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
