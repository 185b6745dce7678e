"""One API call's trip through the engine, shared by every API surface (OpenAI chat/completions,
Anthropic Messages, OpenAI Responses): the default token budget, reading the outputs while watching
for a client that left, and the latency metrics each finished request reports."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from starlette.requests import Request

from mlx_infer.engine.async_engine import AsyncEngine, RequestGroup
from mlx_infer.engine.engine import Engine
from mlx_infer.engine.request import RequestOutput
from mlx_infer.errors import ContextTooLong
from mlx_infer.sampling import SamplingParams
from mlx_infer.server.metrics import Metrics

DISCONNECT_POLL_SECONDS = 0.5


def submit(
    engine: AsyncEngine, requests: list[tuple[list[int], SamplingParams]], prompt_field: str
) -> RequestGroup:
    """``engine.submit``, a prompt too long for the context or the KV pool named as the request field
    that carried it (``param`` of the 400)."""
    try:
        return engine.submit(requests)
    except ContextTooLong as e:
        e.param = e.param or prompt_field
        raise


def default_max_tokens(engine: Engine, num_prompt_tokens: int) -> int:
    """What a request that names no limit may generate: whatever room the context and the KV pool leave."""
    room = min(engine.max_context, engine.pool_tokens) - num_prompt_tokens
    return max(room, 1)


class LatencyClock:
    """Time to first token and time per output token of each request of one call, observed into the
    server's metrics as each request finishes."""

    def __init__(self, metrics: Metrics, num_requests: int):
        self.metrics = metrics
        self.start = time.perf_counter()
        self.first_token: list[float | None] = [None] * num_requests

    def record(self, index: int, out: RequestOutput) -> None:
        t = time.perf_counter()
        if self.first_token[index] is None:
            self.first_token[index] = t
        if out.finished:
            first = self.first_token[index]
            n = out.num_output_tokens
            tpot = (t - first) / (n - 1) if n > 1 else None
            self.metrics.observe(first - self.start, tpot)


async def collect(
    group: RequestGroup, request: Request, on_output: Callable[[int, RequestOutput], None]
) -> bool:
    """Hand every output of ``group`` to ``on_output`` until all its requests finish. Returns False when
    the client disconnected first. The group is closed either way, so nothing is left running."""
    # Check for a disconnect on a clock, not only when outputs pause: a request that streams a token
    # more often than every DISCONNECT_POLL_SECONDS would otherwise never be checked.
    next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
    try:
        while not group.done:
            wait = next_check - time.monotonic()
            if wait <= 0:
                if await request.is_disconnected():
                    return False
                next_check = time.monotonic() + DISCONNECT_POLL_SECONDS
                continue
            try:
                index, out = await asyncio.wait_for(group.next(), wait)
            except asyncio.TimeoutError:
                continue
            on_output(index, out)
        return True
    finally:
        group.close()
