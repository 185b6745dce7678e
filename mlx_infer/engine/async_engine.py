"""The engine on a thread of its own, for asyncio callers (the server).

One thread owns every MLX call: it drains a thread-safe inbox of adds and aborts, runs a step,
and hands each output to its request's asyncio queue through ``call_soon_threadsafe``. When no
request is pending it blocks on the inbox, so an idle server costs nothing.
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
from mlx_infer.errors import MlxInferError, QueueFull
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


class AsyncEngine:
    def __init__(self, engine: Engine, max_pending: int = 256):
        self.engine = engine
        self.max_pending = max_pending  # requests admitted but not finished; beyond it: QueueFull
        self._inbox: queue.SimpleQueue[_Add | _Abort | None] = queue.SimpleQueue()
        self._sinks: dict[str, Sink] = {}
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="mlx-infer-engine", daemon=True)
        self._thread.start()

    @property
    def num_pending(self) -> int:
        return self._pending

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join(timeout=10)

    def submit(self, requests: list[tuple[list[int], SamplingParams]]) -> RequestGroup:
        """Validate and enqueue requests whose outputs share one queue (the ``n`` choices of one API call).

        Raises the typed error of the first invalid request, or QueueFull, before anything is enqueued.
        Must be called from the event loop that will read the outputs.
        """
        for prompt_ids, params in requests:
            self.engine.check_request(prompt_ids, params)
        with self._lock:
            if self._pending + len(requests) > self.max_pending:
                raise QueueFull(f"{self._pending} requests are pending; retry later")
            self._pending += len(requests)
        group = RequestGroup(self, asyncio.get_running_loop())
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
        # MLX streams belong to the thread that made them: this thread needs its own.
        with mx.stream(mx.new_stream(mx.default_device())):
            self._loop()

    def _loop(self) -> None:
        while True:
            block = not self.engine.has_unfinished()
            try:
                while True:
                    command = self._inbox.get(block=block)
                    block = False
                    if command is None:
                        return
                    self._apply(command)
            except queue.Empty:
                pass
            if not self.engine.has_unfinished():
                continue
            try:
                outputs = self.engine.step()
            except Exception as e:  # noqa: BLE001 - fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(e)
                continue
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if sink is not None:
                    sink(out)
                if out.finished:
                    self._sinks.pop(out.request_id, None)

    def _apply(self, command: _Add | _Abort) -> None:
        if isinstance(command, _Abort):
            self.engine.abort(command.request_id)
            self._sinks.pop(command.request_id, None)
            return
        try:
            self.engine.add_request(command.prompt_ids, command.params, command.request_id)
        except MlxInferError as e:
            command.sink(e)
            return
        self._sinks[command.request_id] = command.sink

    def _fail_all(self, error: Exception) -> None:
        for request_id, sink in list(self._sinks.items()):
            self.engine.abort(request_id)
            sink(error)
        self._sinks.clear()


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
            self._loop.call_soon_threadsafe(self._queue.put_nowait, (index, item))

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
