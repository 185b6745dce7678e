"""Several models behind one server: name -> loaded model, in least-recently-used order.

A model is loaded on its first request, within a memory budget (bytes) and a count
(``--max-loaded-models``); to make room, the least recently used *idle* models are unloaded first. A
model's requests are counted from ``acquire`` to ``release`` (a stream's whole life), and a model with
any is never unloaded: when every loaded model is busy and room is needed, the load waits for one to
go idle for up to ``wait_timeout`` seconds, then fails with 503 (Ollama and llama-swap queue such a
request too). A model whose estimate alone exceeds the budget is refused before anything is unloaded.

Bookkeeping runs on the event loop, so it needs no lock of its own. Loading and unloading run on one
loader thread: off the loop that feeds every stream, and one at a time, so that the room made for one
load is not taken by another. Two first requests for one model load it once (a lock per model).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from starlette.types import ASGIApp

from mlx_infer.errors import ModelNotFound, ModelTooLarge, ServiceUnavailable

log = logging.getLogger("mlx_infer")

LOAD_WAIT_SECONDS = 60.0  # how long a load waits for a busy model to go idle before a 503
GIB = 2**30


class Engine(Protocol):
    """What the lifecycle asks of a loaded model's engine (AsyncEngine and AsyncEmbedder both have it)."""

    failure: str | None

    @property
    def num_pending(self) -> int: ...

    @property
    def closed_reason(self) -> str | None: ...

    def close_admission(self, reason: str) -> None: ...

    def abort_all(self, error: Exception) -> None: ...

    def stalled_for(self) -> float: ...


class Loaded(Protocol):
    """A loaded model, as the registry and the server see it."""

    app: ASGIApp  # its own routes, answering requests for this model
    engine: Engine
    footprint: int  # bytes it holds: weights plus its KV pool's budget
    context_length: int

    def close(self) -> None:
        """Stop its engine and let go of its memory (runs on the loader thread)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str  # what requests put in ``model``
    path: str
    size: int  # bytes on disk
    details: dict[str, str] = field(default_factory=dict)  # architecture, quantization


@dataclass
class _Entry:
    spec: ModelSpec
    loaded: Loaded
    in_flight: int = 0


@dataclass
class RegistryStats:
    loads: int = 0
    unloads: int = 0
    last_load_seconds: float = 0.0


class ModelRegistry:
    """``acquire``/``release`` around every request; ``close`` at shutdown. Also what the lifecycle
    supervises in place of one engine (``failure``, ``close_admission``, ``abort_all``, ...)."""

    def __init__(
        self,
        specs: list[ModelSpec],
        load: Callable[[ModelSpec], Loaded],
        estimate: Callable[[ModelSpec], int],
        max_loaded: int,
        memory_budget: int,
        wait_timeout: float = LOAD_WAIT_SECONDS,
    ):
        self.specs = {s.name: s for s in specs}
        self.max_loaded = max_loaded
        self.memory_budget = memory_budget
        self.stats = RegistryStats()
        self._load_fn = load
        self._estimate = estimate
        self._wait_timeout = wait_timeout
        self._loaded: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._loading: dict[str, int] = {}  # name -> estimated bytes, while its load runs
        self._model_locks: dict[str, asyncio.Lock] = {}
        self._room = asyncio.Lock()  # one load (with the unloads that make room for it) at a time
        self._released = asyncio.Event()  # set when a model's last request ends
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="mlx-infer-loader")
        self._closed_reason: str | None = None

    # ---- requests ------------------------------------------------------------------------------
    async def acquire(self, name: str) -> Loaded:
        """The loaded model ``name`` (loading it first if needed), counted busy until ``release``."""
        spec = self.specs.get(name)
        if spec is None:
            raise ModelNotFound(self.not_found_message(name), param="model")
        entry = self._loaded.get(name)
        if entry is None:
            # The wait for room counts from here: requests queued behind another's load of the same
            # model share its deadline rather than each waiting anew once the one before gives up.
            deadline = time.monotonic() + self._wait_timeout
            async with self._model_locks.setdefault(name, asyncio.Lock()):
                entry = self._loaded.get(name) or await self._load(spec, deadline)
                # Counted before any await: an unload cannot come between the load and this request.
                entry.in_flight += 1
        else:
            entry.in_flight += 1
        self._loaded.move_to_end(name)
        return entry.loaded

    def release(self, name: str) -> None:
        entry = self._loaded.get(name)  # a model with requests is unloaded only by close(), at shutdown
        if entry is None:
            return
        entry.in_flight -= 1
        if entry.in_flight == 0:
            self._released.set()

    def not_found_message(self, name: str) -> str:
        loaded = ", ".join(map(repr, self._loaded)) or "none"
        return f"the model {name!r} does not exist; this server serves {self.available()} (loaded: {loaded})"

    def available(self) -> str:
        return ", ".join(map(repr, self.specs))

    def state(self, name: str) -> str:
        """LM Studio's words: "loaded", "loading" or "not-loaded"."""
        if name in self._loaded:
            return "loaded"
        return "loading" if name in self._loading else "not-loaded"

    def loaded(self) -> dict[str, Loaded]:
        return {name: e.loaded for name, e in self._loaded.items()}

    # ---- loading and unloading -------------------------------------------------------------------
    async def _load(self, spec: ModelSpec, deadline: float) -> _Entry:
        if self._closed_reason is not None:
            raise ServiceUnavailable(self._closed_reason)
        # From headers, but a folder's model is built (lazily) to name its weights: off the loop.
        need = await asyncio.get_running_loop().run_in_executor(self._executor, self._estimate, spec)
        if need > self.memory_budget:
            raise ModelTooLarge(
                f"the model {spec.name!r} needs about {need / GIB:.2f} GiB ({need} bytes: weights and KV "
                f"pool) and this server's budget for models is {self.memory_budget / GIB:.2f} GiB "
                f"({self.memory_budget} bytes, --models-memory)",
                param="model",
            )
        async with self._room:
            await self._make_room(spec.name, need, deadline)
            loop = asyncio.get_running_loop()
            start = time.perf_counter()
            self._loading[spec.name] = need
            future = loop.run_in_executor(self._executor, self._load_fn, spec)
            try:
                # Shielded: a request cancelled meanwhile leaves the load running; it still lands here.
                await asyncio.shield(future)
            except asyncio.CancelledError:
                future.add_done_callback(lambda f: self._landed(spec, start, f))
                raise
            except BaseException as e:
                del self._loading[spec.name]
                log.error("could not load %r: %s", spec.name, e)  # the client gets it too, the log keeps it
                raise
            return self._landed(spec, start, future)

    def _landed(self, spec: ModelSpec, start: float, future: asyncio.Future) -> _Entry | None:
        need = self._loading.pop(spec.name)
        if future.cancelled() or future.exception() is not None:
            return None
        loaded = future.result()
        entry = self._loaded[spec.name] = _Entry(spec, loaded)
        self.stats.loads += 1
        self.stats.last_load_seconds = time.perf_counter() - start
        log.info(
            "loaded %r in %.1f s: %.2f GiB held (estimated %.2f), %d of %d models loaded",
            spec.name,
            self.stats.last_load_seconds,
            loaded.footprint / GIB,
            need / GIB,
            len(self._loaded),
            self.max_loaded,
        )
        self._released.set()  # an idle model: a load waiting for room may unload it
        return entry

    def used_bytes(self) -> int:
        return sum(e.loaded.footprint for e in self._loaded.values()) + sum(self._loading.values())

    def _full(self, need: int) -> bool:
        count = len(self._loaded) + len(self._loading)
        return count >= self.max_loaded or self.used_bytes() + need > self.memory_budget

    async def _make_room(self, name: str, need: int, deadline: float) -> None:
        while self._full(need):
            victim = next((e for e in self._loaded.values() if e.in_flight == 0), None)
            if victim is not None:
                await self._unload(victim, f"to make room for {name!r}")
                continue
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                busy = ", ".join(map(repr, self._loaded))
                raise ServiceUnavailable(
                    f"the model {name!r} cannot be loaded now: every loaded model ({busy}) is answering "
                    f"requests and no room is left (--max-loaded-models {self.max_loaded}, --models-memory "
                    f"{self.memory_budget / GIB:.2f} GiB); retry shortly",
                    retry_after=5,
                )
            # No await between the check above and this clear: a release cannot slip through.
            self._released.clear()
            try:
                await asyncio.wait_for(self._released.wait(), remaining)
            except asyncio.TimeoutError:
                pass

    async def _unload(self, entry: _Entry, why: str) -> None:
        del self._loaded[entry.spec.name]  # no request finds it from now on
        log.info("unloading %r %s", entry.spec.name, why)
        await asyncio.get_running_loop().run_in_executor(self._executor, entry.loaded.close)
        self.stats.unloads += 1

    # ---- the lifecycle: what a single engine's supervisor asks, over every loaded model ----------
    @property
    def failure(self) -> str | None:
        for name, entry in self._loaded.items():
            if entry.loaded.engine.failure is not None:
                return f"{name}: {entry.loaded.engine.failure}"
        return None

    def stalled(self, longer_than: float) -> str | None:
        """The first loaded model whose engine's current step has run longer than ``longer_than`` s."""
        for name, entry in self._loaded.items():
            seconds = entry.loaded.engine.stalled_for()
            if seconds > longer_than:
                return f"{name}: its engine's current step has run for {seconds:.0f} s"
        return None

    @property
    def closed_reason(self) -> str | None:
        return self._closed_reason

    @property
    def num_pending(self) -> int:
        return sum(e.loaded.engine.num_pending for e in self._loaded.values())

    def close_admission(self, reason: str) -> None:
        self._closed_reason = reason
        for entry in self._loaded.values():
            entry.loaded.engine.close_admission(reason)

    def abort_all(self, error: Exception) -> None:
        for entry in self._loaded.values():
            entry.loaded.engine.abort_all(error)

    def close(self) -> None:
        """Unload everything (the server has stopped; called off the event loop)."""
        self._executor.shutdown(wait=True)  # a load in progress finishes first
        while self._loaded:
            _, entry = self._loaded.popitem(last=False)
            entry.loaded.close()
