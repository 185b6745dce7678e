"""A chat conversation over the engine: history, system prompt, streaming and per-turn stats.

Each turn sends the whole conversation; the engine's prefix cache finds the blocks of earlier
turns (prompt and answer alike), so only the new message and the tail of the last block are
prefilled.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx

from mlx_infer.engine.engine import Engine
from mlx_infer.engine.request import RequestOutput
from mlx_infer.sampling import SamplingParams


@dataclass
class TurnStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated_tokens: int = 0
    ttft: float = 0.0  # seconds from submission to the first token (the prefill)
    decode_time: float = 0.0  # seconds from the first token to the last
    peak_memory: int = 0  # bytes
    finish_reason: str | None = None

    @property
    def prompt_tps(self) -> float:
        computed = self.prompt_tokens - self.cached_tokens
        return computed / self.ttft if self.ttft > 0 else 0.0

    @property
    def generation_tps(self) -> float:
        return (self.generated_tokens - 1) / self.decode_time if self.decode_time > 0 else 0.0

    def line(self) -> str:
        return (
            f"prompt: {self.prompt_tokens} tokens ({self.cached_tokens} cached), "
            f"{self.prompt_tps:.1f} tok/s | "
            f"generation: {self.generated_tokens} tokens, {self.generation_tps:.1f} tok/s | "
            f"TTFT {self.ttft * 1000:.0f} ms | peak memory {self.peak_memory / 2**30:.2f} GiB"
        )


def stream(engine: Engine, prompt_ids: list[int], params: SamplingParams, stats: TurnStats) -> Iterator[str]:
    """Run one request alone on ``engine``, yielding text deltas; closing the iterator aborts it."""
    start = time.perf_counter()
    request_id = engine.add_request(prompt_ids, params)
    stats.prompt_tokens = len(prompt_ids)
    first = None
    try:
        while True:
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
                    return
    finally:
        engine.abort(request_id)
        stats.peak_memory = mx.get_peak_memory()


@dataclass
class ChatSession:
    engine: Engine
    params: SamplingParams
    system: str | None = None
    use_template: bool = True
    messages: list[dict[str, str]] = field(default_factory=list)

    def reset(self) -> None:
        self.messages.clear()

    def prompt_ids(self, user_text: str) -> list[int]:
        tokenizer = self.engine.tokenizer
        if not self.use_template:
            history = "".join(m["content"] for m in self.messages)
            return tokenizer.encode(history + user_text)
        messages = ([{"role": "system", "content": self.system}] if self.system else []) + self.messages
        return tokenizer.encode_chat(messages + [{"role": "user", "content": user_text}])

    def reply(self, user_text: str, stats: TurnStats) -> Iterator[str]:
        """Stream the answer to ``user_text``; the turn enters the history once the answer is complete
        or interrupted (an interrupted answer is kept as far as it went)."""
        answer = []
        try:
            for delta in stream(self.engine, self.prompt_ids(user_text), self.params, stats):
                answer.append(delta)
                yield delta
        finally:
            self.messages.append({"role": "user", "content": user_text})
            self.messages.append({"role": "assistant", "content": "".join(answer)})

    def save(self, path: str) -> None:
        system = [{"role": "system", "content": self.system}] if self.system else []
        Path(path).write_text(json.dumps(system + self.messages, ensure_ascii=False, indent=2) + "\n")
