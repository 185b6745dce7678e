"""`generate` with tools and reasoning, on the real SmolLM2: forced calls shown as calls (one-shot JSON
lines, `-> name(arguments)` in the chat, kept in the conversation), reasoning split from the answer and
dimmed. SmolLM2 does not reason, so a grammar makes it write a `<think>` block the parser must split."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import jsonschema
import pexpect
import pytest

CLI = [sys.executable, "-m", "mlx_infer.cli"]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# <think> + lowercase reasoning + </think> + a capitalised answer: the split is known exactly.
THINK_GRAMMAR = 'start: "<think>" /[a-z]{3,12}/ "</think>" /[A-Z][a-z]{2,10}/\n'
DIM_ITALIC = "\x1b[2;3m"

pytestmark = pytest.mark.timeout(600)


def _run(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **kw.pop("env", {})}
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=env, timeout=300, **kw)


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "tools.json"
    path.write_text(json.dumps([WEATHER]))
    return path


def test_one_shot_forced_call_is_a_json_line_that_validates(smollm2_path, tools_file):
    result = _run(
        "generate",
        "-m",
        str(smollm2_path),
        "--tools",
        str(tools_file),
        "--tool-choice",
        "get_weather",
        "-p",
        "What's the weather in Paris?",
        "--verbose",
    )
    assert result.returncode == 0, result.stderr
    call = json.loads(result.stdout.strip().splitlines()[-1])
    assert call["name"] == "get_weather"
    jsonschema.validate(call["arguments"], WEATHER["function"]["parameters"])
    assert "finish: tool_calls" in result.stderr


def test_reasoning_goes_to_stderr_and_the_answer_to_stdout(smollm2_path, tmp_path):
    grammar = tmp_path / "think.lark"
    grammar.write_text(THINK_GRAMMAR)
    result = _run(
        "generate",
        "-m",
        str(smollm2_path),
        "--reasoning-parser",
        "think",
        "--grammar",
        str(grammar),
        "-p",
        "What is the capital of France?",
    )
    assert result.returncode == 0, result.stderr
    answer = result.stdout.strip()
    assert answer[:1].isupper() and answer.isalpha() and "think" not in answer, result.stdout
    reasoning = result.stderr.strip().splitlines()[-1]
    assert reasoning.islower() and reasoning.isalpha(), result.stderr


def test_chat_shows_calls_as_calls_and_reasoning_dimmed(smollm2_path, tools_file, tmp_path):
    grammar = tmp_path / "think.lark"
    grammar.write_text(THINK_GRAMMAR)
    saved = tmp_path / "chat.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TERM": "xterm-256color",
        "COLUMNS": "250",
        "FORCE_COLOR": "1",
    }
    args = [
        *CLI[1:],
        "generate",
        "-m",
        str(smollm2_path),
        "--tools",
        str(tools_file),
        "--tool-choice",
        "required",
        "--max-tokens",
        "60",
    ]
    child = pexpect.spawn(CLI[0], args, env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact(">>> ")
        child.sendline("What's the weather in Paris?")
        child.expect(r"-> .*?get_weather\(.*?(\{.*?\}).*?\)")
        arguments = json.loads(_plain(child.match.group(1)))
        jsonschema.validate(arguments, WEATHER["function"]["parameters"])
        child.expect(r"finish: tool_calls")
        child.expect_exact(">>> ")
        child.sendline(f"/save {saved}")
        child.expect("saved to")
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 0
    turn = json.loads(saved.read_text())
    assert [m["role"] for m in turn] == ["user", "assistant"]
    [call] = turn[1]["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == arguments

    args = [
        *CLI[1:],
        "generate",
        "-m",
        str(smollm2_path),
        "--reasoning-parser",
        "think",
        "--grammar",
        str(grammar),
    ]
    child = pexpect.spawn(CLI[0], args, env=env, encoding="utf-8", timeout=180)
    try:
        child.expect_exact(">>> ")
        child.sendline("What is the capital of France?")
        child.expect(r"prompt: \d+ tokens")
        printed = child.before
        child.expect_exact(">>> ")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert DIM_ITALIC in printed, repr(printed)
    dimmed = printed.split(DIM_ITALIC, 1)[1].split("\x1b[0m", 1)[0]
    assert dimmed.islower() and dimmed.isalpha(), repr(printed)
    assert "<think>" not in _plain(printed), repr(printed)


def _plain(text: str) -> str:
    """Text without ANSI escapes."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)
