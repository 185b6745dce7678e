"""The terminal chat under a pseudo-terminal (pexpect, the real SmolLM2): long conversations in a small
context, failing turns that leave the chat running, /save and /load, /stats, multi-line input."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pexpect
import pytest

CLI = [sys.executable, "-m", "mlx_infer.cli"]
PROMPT = ">>> "
STATS = r"prompt: (\d+) tokens \((\d+) cached\).*?finish: (\w+)"
DROPPED = "turn dropped"

pytestmark = pytest.mark.timeout(600)


def _chat(model, *args: str) -> pexpect.spawn:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb", "COLUMNS": "250"}
    child = pexpect.spawn(
        CLI[0], [*CLI[1:], "generate", "-m", str(model), *args], env=env, encoding="utf-8", timeout=180
    )
    child.expect_exact(PROMPT)
    return child


def _turn(child: pexpect.spawn, text: str) -> tuple[str, re.Match]:
    """Send one message; return what was printed before the stats line, and the stats line's match."""
    child.sendline(text)
    index = child.expect([STATS, DROPPED])
    before, match = child.before, child.match
    assert index == 0, f"the turn {text!r} failed: {before}{child.after}"
    child.expect_exact(PROMPT)
    return before, match


def _exit(child: pexpect.spawn) -> None:
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


QUESTIONS = [
    "Tell me about rivers.",
    "And mountains?",
    "And the sea?",
    "What is the capital of France?",
    "Name a fruit.",
    "What colour is the sky?",
    "How many legs does a dog have?",
    "What is 2 + 2?",
    "Name a planet.",
]
SYSTEM = "Your name is Zorblax. When asked your name, answer: My name is Zorblax."


def test_ten_turns_in_a_small_context_all_answered_with_the_system_prompt_kept(smollm2_path):
    child = _chat(smollm2_path, "--max-context", "160", "--max-tokens", "30", "--system", SYSTEM)
    try:
        printed = ""
        for question in QUESTIONS:
            before, match = _turn(child, question)
            printed += before
            assert int(match.group(1)) <= 160 - 30
        assert re.search(r"\d+ earlier turns? left out to fit the context of 160 tokens", printed), printed
        answer, _ = _turn(child, "What is your name?")
        assert "Zorblax" in answer, answer
        _exit(child)
    finally:
        child.close(force=True)


def test_save_load_stats_multiline_and_failing_turns(smollm2_path, tmp_path):
    saved = tmp_path / "chat.json"
    child = _chat(smollm2_path, "--max-context", "512", "--max-tokens", "200", "--context-overflow", "error")
    try:
        answer, _ = _turn(child, "What is the capital of France?")
        assert "Paris" in answer
        _turn(child, "And of Germany?")
        child.sendline(f"/save {saved}")
        child.expect_exact("saved to")
        child.expect_exact(PROMPT)
        messages = json.loads(saved.read_text())
        assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[0]["content"] == "What is the capital of France?"
        assert "Paris" in messages[1]["content"]

        # /load continues the same conversation: its prompt is found in the prefix cache.
        child.sendline("/reset")
        child.expect_exact("conversation cleared")
        child.sendline(f"/load {saved}")
        child.expect_exact("loaded 4 messages")
        child.expect_exact(PROMPT)
        _, match = _turn(child, "And of Italy?")
        prompt_tokens, cached = int(match.group(1)), int(match.group(2))
        assert prompt_tokens > 40 and cached >= prompt_tokens - 16 - 12, (prompt_tokens, cached)

        # /stats turns the stats line off and on.
        child.sendline("/stats")
        child.expect_exact("stats line off")
        child.expect_exact(PROMPT)
        child.sendline("Thank you!")
        child.expect_exact(PROMPT)
        assert "prompt:" not in child.before and DROPPED not in child.before
        child.sendline("/stats")
        child.expect_exact("stats line on")
        child.expect_exact(PROMPT)

        # A message longer than the context (policy "error"): one line, the turn dropped, the chat goes on.
        child.sendline(" ".join(["apple"] * 600))
        child.expect(r"error: the prompt has (\d+) tokens but the context holds 512")
        assert int(child.match.group(1)) > 512
        child.expect_exact(DROPPED)
        child.expect_exact(PROMPT)

        # Ctrl-C during an answer: the turn is dropped, the conversation kept.
        child.sendline("Write a long story about a dragon and a knight.")
        child.expect_exact("a knight.")  # the terminal's echo of the line, not yet the answer
        child.expect(r"\w+ \w+ \w+")  # the answer has started
        child.sendintr()
        child.expect_exact("stopped; " + DROPPED)
        child.expect_exact(PROMPT)

        # A line ending in a backslash continues the message.
        child.sendline("What is the capital\\")
        child.expect_exact("... ")
        answer, _ = _turn(child, "of Spain?")
        assert "Madrid" in answer, answer

        child.sendline(f"/save {saved}")
        child.expect_exact("saved to")
        child.expect_exact(PROMPT)
        contents = [m["content"] for m in json.loads(saved.read_text())]
        assert "What is the capital\nof Spain?" in contents
        assert not any("apple" in c or "dragon" in c for c in contents)  # the failed turns left no trace
        _exit(child)
    finally:
        child.close(force=True)


def test_bad_load_file_changes_nothing(smollm2_path, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]))
    child = _chat(smollm2_path, "--max-tokens", "8")
    try:
        child.sendline(f"/load {bad}")
        child.expect(r"cannot load: .*message 1: role must be 'user' or 'assistant', not 'robot'")
        child.expect_exact(PROMPT)
        child.sendline(f"/load {tmp_path / 'missing.json'}")
        child.expect_exact("cannot load")
        child.expect_exact(PROMPT)
        half_emoji = tmp_path / "half.json"  # valid JSON, but no UTF-8 text: refused, not saved later
        half_emoji.write_text('[{"role": "user", "content": "bad \\ud800 x"}]')
        child.sendline(f"/load {half_emoji}")
        child.expect_exact("message 0 is not valid UTF-8 text: half an emoji (U+D800)")
        child.expect_exact(PROMPT)
        _, match = _turn(child, "Hi!")
        assert int(match.group(1)) < 40  # nothing of the bad files entered the conversation
        _exit(child)
    finally:
        child.close(force=True)


def test_load_takes_openai_message_shapes_and_save_replaces_whole(smollm2_path, tmp_path):
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    openai_shaped = tmp_path / "openai.json"
    openai_shaped.write_text(json.dumps([
        {"role": "user", "content": [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]))
    saved = tmp_path / "saved.json"
    saved.write_text("[]")
    child = _chat(smollm2_path, "--max-tokens", "8")
    try:
        child.sendline(f"/load {openai_shaped}")
        child.expect_exact("(loaded 2 messages")
        child.expect_exact(PROMPT)
        child.sendline(f"/save {saved}")
        child.expect_exact("saved to")
        child.expect_exact(PROMPT)
        _exit(child)
    finally:
        child.close(force=True)
    assert json.loads(saved.read_text()) == [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["openai.json", "saved.json"]  # no partial file left


def test_commands_a_slash_message_and_ctrl_c_at_the_prompt(smollm2_path, tmp_path):
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    child = _chat(smollm2_path, "--max-tokens", "8")
    try:
        child.sendline(f"/load {binary}")  # not UTF-8: refused, the chat goes on
        child.expect_exact("cannot load")
        child.expect_exact(PROMPT)
        child.sendline("/save")
        child.expect_exact("usage: /save FILE")
        child.expect_exact(PROMPT)
        child.sendline("/usr/bin/python")
        child.expect_exact("unknown command /usr/bin/python")
        child.expect_exact(PROMPT)
        child.sendline("/system")
        child.expect_exact("system prompt cleared")
        child.expect_exact(PROMPT)
        _, match = _turn(child, "//usr/bin/python is missing")  # sent, as a message that starts with "/"
        assert int(match.group(1)) > 5
        child.sendintr()  # at the prompt: a hint, the conversation stays
        child.expect_exact("Ctrl-C again")
        child.expect_exact(PROMPT)
        _, match = _turn(child, "Hi!")
        assert int(match.group(2)) > 0  # the earlier turn is still there, in the prefix cache
        child.sendintr()
        child.expect_exact(PROMPT)
        child.sendintr()  # twice in a row: leave, as an interrupted command
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 130
    finally:
        child.close(force=True)


def test_version():
    result = subprocess.run([*CLI, "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(r"mlx-infer \d+\.\d+\.\d+\S*\n", result.stdout), result.stdout
