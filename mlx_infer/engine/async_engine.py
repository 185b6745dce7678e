"""The engine on a thread of its own, for asyncio callers (the server).

One thread owns every MLX call: it drains a thread-safe inbox of adds and aborts, runs a step,
and hands each output to its request's asyncio queue through ``call_soon_threadsafe``. When no
request is pending it blocks on the inbox, so an idle server costs nothing; once idle for
``--kv-idle-release`` seconds it gives the KV pool's extra memory back first.

A request that fails inside the engine gets its error alone (the engine isolates it). If the thread
stops anyway, ``failure`` says why, every request in flight gets EngineFailure and every later
``submit`` raises it at once, so no caller waits on a thread that is gone.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import mlx.core as mx

from mlx_infer.engine.engine import Engine
from mlx_infer.engine.request import RequestOutput
from mlx_infer.engine.step_clock import StepClock
from mlx_infer.errors import (
    EngineFailure,
    MlxInferError,
    QueueFull,
    RequestFailed,
    ServiceUnavailable,
)
from mlx_infer.sampling import SamplingParams

log = logging.getLogger("mlx_infer")

Sink = Callable[[RequestOutput | BaseException], None]


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Sink


@dataclass
class _Abort:
    request_id: str


@dataclass
class _AbortAll:
    error: Exception  # what every unfinished request receives


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine = engine
        self.max_pending = max_pending  # requests admitted but not finished; beyond it: QueueFull
        self._inbox: queue.SimpleQueue[_Add | _Abort | _AbortAll | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._pending = 0
        self._lock = threading.Lock()  # guards _pending, _closed_reason, failure and what enters the inbox
        self._closed_reason: str | None = None  # admission closed (shutting down): new submits get 503
        self.failure: str | None = None  # why the engine thread stopped; None while it runs
        self.clock = StepClock()  # how long the step running now has taken (/health: stalled)
        self._thread = threading.Thread(target=self._run, name="mlx-infer-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._pending

    def stalled_for(self) -> float:
        return self.clock.stalled_for()

    @property
    def closed_reason(self) -> str | None:
        """Why admission is closed (the server is shutting down), or None."""
        return self._closed_reason

    @property
    def num_tracked(self) -> int:
        """Requests the engine thread holds outputs for (0 when idle: nothing leaked)."""
        return len(self._sinks)

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def close_admission(self, reason: str) -> None:
        """Refuse new requests from now on (503 with ``reason``); those admitted go on."""
        with self._lock:
            self._closed_reason = reason

    def abort_all(self, error: Exception) -> None:
        """Finish every unfinished request at once; each receives ``error`` as its last output."""
        self._inbox.put(_AbortAll(error))

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> RequestGroup:
        """Validate and enqueue requests whose outputs share one queue (the ``n`` choices of one API call).

        Raises the typed error of the first invalid request, QueueFull, or ServiceUnavailable (admission
        closed, engine stopped) before anything is enqueued. Must be called from the event loop that
        will read the outputs.
        """
        for prompt_ids, params in requests:
            self.engine.check_request(prompt_ids, params)
        group = RequestGroup(self, asyncio.get_running_loop())
        with self._lock:
            if self.failure is not None:
                raise EngineFailure(f"the engine has stopped: {self.failure}")
            if self._closed_reason is not None:
                raise ServiceUnavailable(self._closed_reason)
            # A group larger than the limit is admitted alone: refusing it would be a 429 that no retry
            # can ever turn into an answer.
            if self._pending and self._pending + len(requests) > self.max_pending:
                raise QueueFull(
                    f"{self._pending} requests are pending (--max-pending {self.max_pending}); retry later"
                )
            self._pending += len(requests)
            # Enqueued under the lock: a dying engine thread, which sets ``failure`` under it first,
            # then drains the inbox, answers every add that got in.
            for prompt_ids, params in requests:
                request_id = self.engine.new_request_id()
                group.request_ids.append(request_id)
                self._inbox.put(
                    _Add(request_id, list(prompt_ids), params, group.sink(len(group.request_ids) - 1))
                )
        return group

    def _abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    def _release(self, count: int) -> None:
        with self._lock:
            self._pending -= count

    # ---- the engine thread -----------------------------------------------------------------------
    def _run(self) -> None:
        try:
            # MLX streams belong to the thread that made them: this thread needs its own.
            with mx.stream(mx.new_stream(mx.default_device())):
                self._loop()
        except BaseException as e:  # noqa: BLE001 - whatever stops the thread is reported, not swallowed
            log.critical("the engine thread stopped", exc_info=e)
            self._die(f"{type(e).__name__}: {e}")

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            # Idle, the wait is bounded while the KV pool has memory to give back after that long.
            timeout = self.engine.kv_idle_timeout() if block else None
            try:
                while True:
                    command = self._inbox.get(block=block, timeout=timeout)
                    block = False
                    if command is None:
                        return
                    self._apply(command)
            except queue.Empty:
                if block:  # idle for the whole timeout
                    self.engine.release_idle_kv()
            if not self.engine.has_unfinished():
                continue
            # The engine fails requests (or a whole step) on its own; what escapes is fatal.
            with self.clock.timing():
                outputs = self.engine.step()
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(_client_error(out.error) if out.error is not None else out)
                if out.finished:
                    self._sinks.pop(out.request_id, None)

    def _apply(self, command: _Add | _Abort | _AbortAll) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            self._sinks.pop(command.request_id, None)
            return
        if isinstance(command, _AbortAll):
            for request_id, sink in list(self._sinks.items()):
                self.engine.abort(request_id)
                sink(command.error)
            self._sinks.clear()
            return
        try:
            self.engine.add_request(command.prompt_ids, command.params, command.request_id)
        except Exception as e:  # noqa: BLE001 - a request that cannot be added fails alone
            self.engine.abort(command.request_id)
            command.sink(_client_error(e))
            return
        self._sinks[command.request_id] = command.sink

    def _die(self, reason: str) -> None:
        with self._lock:
            self.failure = reason
        error = EngineFailure(f"the engine has stopped: {reason}")
        for sink in self._sinks.values():
            sink(error)
        self._sinks.clear()
        while True:
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                command.sink(error)


def _client_error(error: Exception) -> Exception:
    """What a client is told when its request failed inside the engine: typed errors as they are,
    anything else as a RequestFailed naming only the exception's type (the log has the details)."""
    if isinstance(error, MlxInferError):
        return error
    return RequestFailed(f"the request failed in the engine ({type(error).__name__})")


class RequestGroup:
    """The requests of one API call; iterate for ``(choice index, output)`` pairs as they arrive.

    ``close()`` (also on cancellation, e.g. a client disconnect) aborts whatever has not finished, so
    its KV blocks return to the pool at once.
    """

    def __init__(self, engine: AsyncEngine, loop: asyncio.AbstractEventLoop):
        self._engine = engine
        self._loop = loop
        self._queue: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue()
        self.request_ids: list[str] = []
        self._finished: set[int] = set()
        self._closed = False

    def sink(self, index: int) -> Sink:
        def put(item: RequestOutput | BaseException) -> None:
            try:
                self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))
            except RuntimeError:
                pass  # the caller's event loop is closed: no one is left to read this output

        return put

    @property
    def done(self) -> bool:
        return len(self._finished) == len(self.request_ids)

    async def next(self) -> tuple[int, RequestOutput]:
        index, item = await self._queue.get()
        if isinstance(item, BaseException):
            self._finished.add(index)
            raise item
        if item.finished:
            self._finished.add(index)
        return index, item

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while not self.done:
                yield await self.next()
        finally:
            self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for index, request_id in enumerate(self.request_ids):
            if index not in self._finished:
                self._engine._abort(request_id)
        self._engine._release(len(self.request_ids))
