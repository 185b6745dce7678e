"""What happens when a conversation outgrows the context: whole turns are dropped, or the request fails.

The chat (``generate``) and the server's chat completions share this module. A turn is a user message
and everything up to the next user message (the answer, tool calls and tool results go with it). The
leading system/developer messages and the last turn (the question being asked) are never dropped.

- ``truncate-oldest``: drop the oldest turns first (Ollama's and LM Studio's rolling window).
- ``truncate-middle``: keep the first turn, which often sets the task, and drop the ones after it,
  oldest first; the first turn goes last (LM Studio's "truncate middle").
- ``error``: send the conversation as it is; the engine refuses a prompt longer than the context.

Turns are dropped until the prompt plus a reserve for the answer fits. The answer itself is never
refused for lack of room: the engine generates until the context is full and finishes with ``length``.
"""

from __future__ import annotations

import argparse
import bisect
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mlx_infer.sampling import SamplingParams

Policy = Literal["truncate-oldest", "truncate-middle", "error"]
POLICIES: tuple[str, ...] = get_args(Policy)
PINNED_ROLES = ("system", "developer")
# The room kept for the answer when max_tokens is not given: the CLI's default answer length.
DEFAULT_ANSWER_RESERVE = SamplingParams.max_tokens

Message = dict[str, Any]
Render = Callable[[list[Message]], list[int]]


@dataclass(frozen=True)
class Fitted:
    prompt_ids: list[int]
    dropped_turns: int  # turns left out of the prompt


def add_argument(parser: argparse.ArgumentParser, default: str) -> None:
    """``--context-overflow`` (generate: the chat's policy; serve: the default of requests)."""
    parser.add_argument(
        "--context-overflow",
        choices=POLICIES,
        default=default,
        help="when a conversation outgrows the context: drop whole turns (oldest first, or those after "
        f"the first) or fail; never the system prompt or the last message (default: {default})",
    )


def answer_reserve(max_tokens: int | None, limit: int) -> int:
    """Tokens kept free for the answer when turns are dropped: max_tokens, but at most half the context
    (a small context must still hold the latest turn; the answer then ends with ``length``)."""
    return min(max_tokens or DEFAULT_ANSWER_RESERVE, limit // 2)


def split_turns(messages: Sequence[Message]) -> tuple[list[Message], list[list[Message]], list[Message]]:
    """(pinned head, droppable turns oldest first, last turn)."""
    start = 0
    while start < len(messages) and messages[start].get("role") in PINNED_ROLES:
        start += 1
    users = [i for i in range(start, len(messages)) if messages[i].get("role") == "user"]
    if not users:
        return list(messages[:start]), [], list(messages[start:])
    bounds = [start, *(u for u in users[:-1] if u > start), users[-1]]
    turns = [list(messages[a:b]) for a, b in zip(bounds, bounds[1:]) if a < b]
    return list(messages[:start]), turns, list(messages[users[-1] :])


def fit(messages: Sequence[Message], render: Render, max_prompt: int, policy: str) -> Fitted:
    """The prompt for ``messages`` within ``max_prompt`` tokens, dropping as few whole turns as the
    policy needs; when even the pinned messages alone are longer, all droppable turns are dropped and
    the engine reports the prompt's length against the context."""
    if policy not in POLICIES:
        raise ValueError(f"unknown context overflow policy {policy!r}; one of {', '.join(POLICIES)}")
    full = render(list(messages))
    if len(full) <= max_prompt or policy == "error":
        return Fitted(full, 0)
    head, turns, last = split_turns(messages)
    order = list(range(len(turns)))
    if policy == "truncate-middle":
        order = order[1:] + order[:1]

    @functools.cache
    def prompt(dropped: int) -> tuple[int, ...]:
        gone = set(order[:dropped])
        kept = [m for i, turn in enumerate(turns) if i not in gone for m in turn]
        return tuple(render(head + kept + last))

    # The prompt shrinks as turns go: the fewest dropped turns that fit, by bisection.
    dropped = bisect.bisect_left(range(len(turns) + 1), True, key=lambda k: len(prompt(k)) <= max_prompt)
    dropped = min(dropped, len(turns))
    return Fitted(list(prompt(dropped)), dropped)


def fit_for_engine(
    messages: Sequence[Message],
    render: Render,
    engine,
    max_tokens: int | None,
    policy: str,
    max_prompt: int | None = None,
) -> Fitted:
    """``fit`` against ``engine``'s context, keeping room for the answer; ``max_prompt`` caps the prompt
    further (vLLM's ``truncate_prompt_tokens``)."""
    limit = engine.sequence_limit  # the context, or the KV pool when that is smaller
    budget = limit - answer_reserve(max_tokens, limit)
    if max_prompt is not None:
        budget = min(budget, max_prompt)
    return fit(messages, render, budget, policy)


def request_policy(
    default: str, context_overflow: str | None, truncate_prompt_tokens: int | None
) -> tuple[str, int | None]:
    """(policy, prompt cap) of one API request: its own ``context_overflow``, else ``truncate-oldest``
    when it sets vLLM's ``truncate_prompt_tokens`` (-1: the context is the cap), else the server's."""
    max_prompt = truncate_prompt_tokens if truncate_prompt_tokens not in (None, -1) else None
    if context_overflow is not None:
        return context_overflow, max_prompt
    if truncate_prompt_tokens is not None:
        return "truncate-oldest", max_prompt
    return default, None
