"""The embedding model on a thread of its own, for the server: requests that arrive together share forwards.

``serve`` on an embedding model runs this instead of the generation engine. The thread owns every MLX
call; it blocks on its inbox, takes every request waiting there, embeds their inputs together (sorted by
length, in forwards bounded by a token and an input budget, ``EmbeddingModel.embed``) and hands each
request its rows. Concurrent clients sending one text each are so batched like one client sending many.

It offers the lifecycle surface of ``AsyncEngine`` that ``server/lifecycle.py`` drives (``failure``,
``closed_reason``, ``close_admission``, ``num_pending``, ``abort_all``, ``close``). A forward that fails
fails the requests in it alone; only an error that escapes the loop stops the thread.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from mlx_infer.embedding import EmbeddingModel
from mlx_infer.engine.step_clock import StepClock
from mlx_infer.errors import EngineFailure, MlxInferError, QueueFull, RequestFailed, ServiceUnavailable

log = logging.getLogger("mlx_infer")


@dataclass(eq=False)  # identity hashing: jobs live in a set
class _Job:
    inputs: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop

    def settle(self, result: np.ndarray | BaseException) -> None:
        """Hand ``result`` to the waiting coroutine (from any thread); a cancelled wait ignores it."""

        def set_it() -> None:
            if self.future.done():
                return
            if isinstance(result, BaseException):
                self.future.set_exception(result)
            else:
                self.future.set_result(result)

        try:
            self.loop.call_soon_threadsafe(set_it)
        except RuntimeError:
            pass  # the caller's loop is closed: no one is left to read this result


@dataclass
class EmbeddingStats:
    requests: int = 0
    inputs: int = 0
    tokens: int = 0
    failed_requests: int = 0


class AsyncEmbedder:
    def __init__(
        self, model: EmbeddingModel, max_batch_tokens: int, max_batch_size: int, max_pending: int = 256
    ):
        self.model = model
        self.max_batch_tokens = max(max_batch_tokens, model.max_tokens)  # an input of any allowed length fits
        self.max_batch_size = max_batch_size
        self.max_pending = max_pending
        self.stats = EmbeddingStats()
        self.failure: str | None = None  # why the thread stopped; None while it runs
        self.clock = StepClock()  # how long the forward running now has taken (/health: stalled)
        self._closed_reason: str | None = None
        self._pending = 0
        self._jobs: set[_Job] = set()  # admitted, unanswered (touched on the event loop only)
        self._lock = threading.Lock()  # guards _pending, _closed_reason, failure and what enters the inbox
        self._inbox: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="mlx-infer-embedder", daemon=True)
        self._thread.start()

    # ---- the lifecycle surface of AsyncEngine ----------------------------------------------------------
    @property
    def num_pending(self) -> int:
        return self._pending

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    def stalled_for(self) -> float:
        return self.clock.stalled_for()

    def close_admission(self, reason: str) -> None:
        with self._lock:
            self._closed_reason = reason

    def abort_all(self, error: Exception) -> None:
        """Answer every unanswered request with ``error`` now (call on the event loop)."""
        for job in list(self._jobs):
            if not job.future.done():
                job.future.set_exception(error)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    # ---- requests ------------------------------------------------------------------------------------------
    async def embed(self, inputs: Sequence[Sequence[int]]) -> np.ndarray:
        """float32 ``[len(inputs), dimension]`` for checked inputs (``EmbeddingModel.check``)."""
        loop = asyncio.get_running_loop()
        job = _Job([list(ids) for ids in inputs], loop.create_future(), loop)
        with self._lock:
            if self.failure is not None:
                raise EngineFailure(f"the engine has stopped: {self.failure}")
            if self._closed_reason is not None:
                raise ServiceUnavailable(self._closed_reason)
            if self._pending >= self.max_pending:
                raise QueueFull(f"{self._pending} requests are pending; retry later")
            self._pending += 1
            self._inbox.put(job)  # under the lock: a dying thread answers every job that got in
        self._jobs.add(job)
        try:
            return await job.future
        finally:
            self._jobs.discard(job)
            with self._lock:
                self._pending -= 1

    # ---- the thread ----------------------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with mx.stream(mx.new_stream(mx.default_device())):  # MLX streams belong to their thread
                while (jobs := self._take()) is not None:
                    self._serve(jobs)
        except BaseException as e:  # noqa: BLE001 - whatever stops the thread is reported, not swallowed
            log.critical("the embedding thread stopped", exc_info=e)
            self._die(f"{type(e).__name__}: {e}")

    def _take(self) -> list[_Job] | None:
        """Every job waiting (blocking for the first); None once closed."""
        jobs = [self._inbox.get()]
        while True:
            try:
                jobs.append(self._inbox.get_nowait())
            except queue.Empty:
                break
        if any(job is None for job in jobs):
            for job in jobs:
                if job is not None:
                    job.settle(ServiceUnavailable("the server shut down before this request finished"))
            return None
        return [job for job in jobs if not job.future.done()]  # a client that left needs nothing

    def _serve(self, jobs: list[_Job]) -> None:
        if not jobs:
            return
        inputs = [ids for job in jobs for ids in job.inputs]
        try:
            with self.clock.timing():
                vectors = self.model.embed(inputs, self.max_batch_tokens, self.max_batch_size)
        except Exception as e:  # noqa: BLE001 - a failed forward fails its requests, not the server
            log.exception("an embedding forward failed")
            error = (
                e
                if isinstance(e, MlxInferError)
                else RequestFailed(f"the request failed in the engine ({type(e).__name__})")
            )
            self.stats.failed_requests += len(jobs)
            for job in jobs:
                job.settle(error)
            return
        self.stats.requests += len(jobs)
        self.stats.inputs += len(inputs)
        self.stats.tokens += sum(len(ids) for ids in inputs)
        start = 0
        for job in jobs:
            job.settle(vectors[start : start + len(job.inputs)])
            start += len(job.inputs)

    def _die(self, reason: str) -> None:
        with self._lock:
            self.failure = reason
        error = EngineFailure(f"the engine has stopped: {reason}")
        while True:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                job.settle(error)
