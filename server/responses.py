"""OpenAI response and stream-chunk bodies built from engine outputs."""

from __future__ import annotations

import codecs
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from mlx_infer.engine.request import RequestOutput, TokenLogprob


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: list[TokenLogprob] | None = None  # the prompt's, when asked for (echo)

    def add(self, out: RequestOutput) -> None:
        if out.prompt_logprobs is not None:
            self.prompt_logprobs = out.prompt_logprobs
        self.text.append(out.text)
        self.logprobs.extend(out.logprobs or [])
        self.num_output_tokens = out.num_output_tokens
        self.num_cached_tokens = out.num_cached_tokens
        if out.finished:
            self.finish_reason = out.finish_reason


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def usage(num_prompt_tokens: int, choices: list[Choice]) -> dict[str, Any]:
    completion = sum(c.num_output_tokens for c in choices)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": choices[0].num_cached_tokens if choices else 0},
    }


def _token_text(raw: bytes) -> str:
    """A token's text, or for a piece of a character (whose bytes joined with its neighbours' spell the
    text) ``bytes:\\xNN...``, as OpenAI writes such a piece."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class LogprobFormatter:
    """Turns token ids into the text OpenAI's logprobs fields carry."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def _text(self, token_id: int) -> str:
        return _token_text(self.tokenizer.token_bytes(token_id))

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            raw = self.tokenizer.token_bytes(token_id)
            return {"token": _token_text(raw), "logprob": logprob, "bytes": list(raw)}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                for e in entries
            ]
        }

    def _completion_top(self, entry: TokenLogprob) -> dict[str, float]:
        """The alternatives and, where it is not among them, the chosen token: OpenAI's legacy API
        "always returns the logprob of the sampled token", up to ``logprobs`` + 1 entries (as vLLM)."""
        top = {self._text(t): lp for t, lp in entry.top}
        top.setdefault(self._text(entry.token_id), entry.logprob)
        return top

    def completion(self, entries: list[TokenLogprob], text_offset: int) -> dict[str, Any]:
        # An offset counts the characters of the text before the token: the pieces of one character
        # (an emoji split in tokens) share the offset where it starts.
        tokens, offsets = [], []
        characters = codecs.getincrementaldecoder("utf-8")(errors="replace")
        for e in entries:
            offsets.append(text_offset)
            raw = self.tokenizer.token_bytes(e.token_id)
            tokens.append(_token_text(raw))
            text_offset += len(characters.decode(raw))
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            # An entry without a log-probability (an echoed prompt's first token) has no top either.
            "top_logprobs": [None if e.logprob is None else self._completion_top(e) for e in entries],
            "text_offset": offsets,
        }
