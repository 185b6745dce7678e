"""A chat conversation over the engine: history, system prompt, streaming and per-turn stats.

Each turn sends the whole conversation; the engine's prefix cache finds the blocks of earlier
turns (prompt and answer alike), so only the new message and the tail of the last block are
prefilled. A conversation longer than the context is sent without its oldest turns (per the
``context_policy``), and a turn enters the history only once it is answered.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_infer.context_policy import fit_for_engine
from mlx_infer.engine.engine import Engine
from mlx_infer.engine.request import RequestOutput
from mlx_infer.errors import InvalidRequest, RequestFailed
from mlx_infer.sampling import SamplingParams
from mlx_infer.tool_calls import ChatPlan, Event, OutputParser, ParsedOutput
from mlx_infer.user_text import checked_text

CONVERSATION_ROLES = ("user", "assistant")


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft: float = 0.0  # seconds from submission to the first token (the prefill)
    decode_time: float = 0.0  # seconds from the first token to the last
    peak_memory: int = 0  # bytes
    finish_reason: str | None = None
    dropped_turns: int = 0  # earlier turns left out of the prompt to fit the context
    context: int = 0  # tokens one sequence can hold (0: unknown)
    spec_proposed: int = 0  # speculative tokens proposed for this turn (0: none, or speculation off)
    spec_accepted: int = 0

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft if self.ttft > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return (self.generated_tokens - 1) / self.decode_time if self.decode_time > 0 else 0.0

    @property
    def context_full(self) -> bool:
        return self.context > 0 and self.prompt_tokens + self.generated_tokens >= self.context

    def line(self) -> str:
        finish = self.finish_reason or "none"
        if finish == "length" and self.context_full:
            finish += f" (context of {self.context} tokens full)"
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
            f"{self.prompt_tps:.1f} tok/s | "
            f"generation: {self.generated_tokens} tokens, {self.generation_tps:.1f} tok/s | "
            f"TTFT {self.ttft * 1000:.0f} ms | peak memory {self.peak_memory / 2**30:.2f} GiB | "
            f"{self._speculation()}finish: {finish}"
        )

    def _speculation(self) -> str:
        if not self.spec_proposed:
            return ""
        rate = self.spec_accepted / self.spec_proposed
        return f"speculative: {self.spec_accepted}/{self.spec_proposed} accepted ({rate:.0%}) | "


def stream(
    engine: Engine,
    prompt_ids: list[int],
    params: SamplingParams,
    stats: TurnStats,
    cancel: threading.Event | None = None,
) -> Iterator[str]:
    """Run one request alone on ``engine``, yielding text deltas; closing the iterator aborts it.

    ``cancel`` (set by a SIGINT handler) is checked between steps, so an interrupt never lands in the
    middle of one: it raises KeyboardInterrupt there and the request is aborted cleanly.
    """
    start = time.perf_counter()
    request_id = engine.add_request(prompt_ids, params)
    # The engine's counters, read before and after: this request runs alone.
    proposed, accepted = engine.stats.spec_proposed, engine.stats.spec_accepted
    stats.prompt_tokens = len(prompt_ids)
    first = None
    try:
        while True:
            if cancel is not None and cancel.is_set():
                raise KeyboardInterrupt
            outputs: list[RequestOutput] = [o for o in engine.step() if o.request_id == request_id]
            for out in outputs:
                now = time.perf_counter()
                if first is None:
                    first = now
                    stats.ttft = now - start
                    stats.cached_tokens = out.num_cached_tokens
                stats.generated_tokens = out.num_output_tokens
                stats.decode_time = now - first
                if out.text:
                    yield out.text
                if out.finished:
                    stats.finish_reason = out.finish_reason
                    if out.finish_reason == "error":
                        raise RequestFailed(f"{type(out.error).__name__}: {out.error}")
                    return
    finally:
        engine.abort(request_id)
        stats.peak_memory = mx.get_peak_memory()
        stats.spec_proposed = engine.stats.spec_proposed - proposed
        stats.spec_accepted = engine.stats.spec_accepted - accepted


@dataclass
class ChatSession:
    engine: Engine
    params: SamplingParams
    system: str | None = None
    use_template: bool = True
    messages: list[dict[str, Any]] = field(default_factory=list)
    context_overflow: str = "truncate-oldest"  # a context_policy.POLICIES entry
    plan: ChatPlan | None = None  # tools, tool-call and reasoning parsing (with a chat template only)

    def reset(self) -> None:
        self.messages.clear()

    def conversation(self) -> list[dict[str, Any]]:
        """The messages sent with each turn: the system prompt (with a chat template) and the history."""
        system = [{"role": "system", "content": self.system}] if self.system and self.use_template else []
        return system + self.messages

    def _render(self, messages: list[dict[str, Any]]) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not self.use_template:
            return tokenizer.encode("".join(m["content"] for m in messages))
        if self.plan is not None:
            return self.plan.render(messages)
        return tokenizer.encode_chat(messages)

    def reply(
        self, user_text: str, stats: TurnStats, cancel: threading.Event | None = None
    ) -> Iterator[Event]:
        """Stream the answer to ``user_text`` as text, reasoning and tool-call events. The turn enters
        the history once answered; a turn that fails or is interrupted leaves the conversation as it was."""
        turn = [{"role": "user", "content": checked_text(user_text, "the message")}]
        policy, max_tokens = self.context_overflow, self.params.max_tokens
        fitted = fit_for_engine(self.conversation() + turn, self._render, self.engine, max_tokens, policy)
        stats.dropped_turns = fitted.dropped_turns
        stats.context = self.engine.sequence_limit
        parser = self.plan.parser(fitted.prompt_ids) if self.plan and self.use_template else OutputParser()
        # The engine ends the answer with "length" when the context fills before max_tokens.
        for delta in stream(self.engine, fitted.prompt_ids, self.params, stats, cancel):
            yield from parser.feed(delta)
        yield from parser.finish()
        if parser.has_tool_calls and stats.finish_reason == "stop":
            stats.finish_reason = "tool_calls"  # as the server reports an answer that calls tools
        self.messages.extend(turn + [_assistant_message(parser.result)])

    def save(self, path: str) -> None:
        """Write the conversation as JSON in OpenAI's messages shape (system prompt first). The file is
        replaced whole or not at all: written beside it, then renamed over it."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        data = (json.dumps(system + self.messages, ensure_ascii=False, indent=2) + "\n").encode("utf-8")
        target = Path(path)
        partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
        try:
            partial.write_bytes(data)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)

    def load(self, path: str) -> None:
        """Replace the conversation (and the system prompt) with one ``save`` wrote, or any list of
        OpenAI messages with string contents; a bad file changes nothing."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise InvalidRequest(f"{path} is not JSON text: {e}") from None
        system, messages = _parse_messages(data, path)
        self.system = system
        self.messages = messages


def _assistant_message(answer: ParsedOutput) -> dict[str, Any]:
    """The answer as the history keeps it: the text and any calls, in OpenAI's shape; the reasoning is
    left out, as chat templates of reasoning models leave it out of earlier turns."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in answer.tool_calls
        ]
    return message


def _parse_messages(data: Any, path: str) -> tuple[str | None, list[dict[str, Any]]]:
    if not isinstance(data, list):
        raise InvalidRequest(f"{path}: expected a JSON list of messages")
    system = None
    messages = []
    for i, m in enumerate(data):
        content = _content_text(m)
        if content is None:
            raise InvalidRequest(f"{path}: message {i} needs its content as a string or a list of text parts")
        checked_text(json.dumps(m, ensure_ascii=False), f"{path}: message {i}")
        role = m.get("role")
        if role == "system" and i == 0:
            system = content
        elif role in CONVERSATION_ROLES:
            message = {"role": role, "content": content}
            if role == "assistant" and isinstance(m.get("tool_calls"), list):
                message["tool_calls"] = m["tool_calls"]  # what /save wrote of a turn that called a tool
            messages.append(message)
        elif role == "system":
            raise InvalidRequest(f"{path}: message {i}: a system message must come first")
        else:
            raise InvalidRequest(f"{path}: message {i}: role must be 'user' or 'assistant', not {role!r}")
    return system, messages


def _content_text(message: Any) -> str | None:
    """A message's content as text, in each shape OpenAI's API has for it: a string, a list of text
    parts, or null on an assistant message that only calls tools; None for anything else."""
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None and message.get("role") == "assistant" and message.get("tool_calls"):
        return ""
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    return content if isinstance(content, str) else None
