"""The serve process around the app: 503 while the model loads, a graceful stop on SIGTERM/SIGINT,
and an exit with EngineFailure's status once the engine has stopped, so a supervisor restarts it."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
import uuid
from types import FrameType

import uvicorn
from starlette.datastructures import Headers
from starlette.responses import HTMLResponse, JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from mlx_infer.cli_options import FINAL_ERROR_S
from mlx_infer.engine.async_engine import AsyncEngine
from mlx_infer.errors import ServiceUnavailable
from mlx_infer.server.errors import anthropic_error_response, anthropic_shaped, error_response
from mlx_infer.server.request_body import STOP_READING

log = logging.getLogger("mlx_infer")

ENGINE_FAILURE_GRACE_SECONDS = 3.0  # /health reports the failure this long before the process exits


class Supervisor:
    """The ASGI app uvicorn serves: 503 for everything while the model loads, then the real app."""

    def __init__(self, web: bool = True) -> None:
        self.web = web  # the chat page at /: a browser there gets a page that waits, not JSON
        self.app: ASGIApp | None = None
        self.engine: AsyncEngine | None = None
        self.load_error: BaseException | None = None
        # Set when the shutdown's wait is over: a request whose body is still arriving gets its 503 then
        # (request_body.read_body) rather than holding the process past --shutdown-timeout.
        self.stop_reading: asyncio.Event | None = None

    def ready(self, engine: AsyncEngine, app: ASGIApp) -> None:
        self.engine, self.app = engine, app

    def load_failed(self, error: BaseException) -> None:
        self.load_error = error

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            send = _with_request_id(scope, send)
            if self.stop_reading is None:
                self.stop_reading = asyncio.Event()  # made on the server's loop
            scope = {**scope, "state": {**scope.get("state", {}), STOP_READING: self.stop_reading}}
        if scope["type"] == "lifespan":
            # Nothing to set up or tear down here: the loader thread owns the engine.
            while True:
                message = await receive()
                await send({"type": message["type"] + ".complete"})
                if message["type"] == "lifespan.shutdown":
                    return
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":
            return
        loading, retry = "the model is loading; retry shortly", {"Retry-After": "5"}
        headers = Headers(scope=scope)
        if scope["path"] == "/health":
            response = JSONResponse({"status": "loading"}, status_code=503)
        elif self.web and scope["path"] == "/" and "text/html" in headers.get("accept", ""):
            response = HTMLResponse(LOADING_PAGE, status_code=503, headers=retry)
        elif anthropic_shaped(scope["path"], headers):
            response = anthropic_error_response(503, loading, headers=retry)
        else:
            response = error_response(503, loading, "server_error", headers=retry)
        await response(scope, receive, send)


# What a browser opening the chat page sees while the model loads: a line, and a reload every 3 s.
LOADING_PAGE = (
    '<!doctype html><html lang="en"><head><meta charset="utf-8"><meta http-equiv="refresh" content="3">'
    "<title>mlx-infer: loading</title></head><body><p>The model is loading; this page opens the chat "
    "when it is ready.</p></body></html>"
)


def _with_request_id(scope: Scope, send: Send) -> Send:
    """Every answer names its request as OpenAI's (``x-request-id``) and Anthropic's (``request-id``) do,
    which their clients show as ``_request_id`` for a user's bug report and the log: the caller's own
    ``X-Request-Id`` when it sent one (as a proxy in front passes it on), else a new one."""
    given = dict(scope["headers"]).get(b"x-request-id", b"")
    request_id = given.decode("latin-1") if 0 < len(given) <= 128 else f"req_{uuid.uuid4().hex}"
    added = [(b"x-request-id", request_id.encode("latin-1")), (b"request-id", request_id.encode("latin-1"))]

    async def send_with_id(message: Message) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *added]}
        await send(message)

    return send_with_id


class ServeServer(uvicorn.Server):
    """uvicorn's server with mlx-infer's stop rules.

    SIGTERM/SIGINT: new requests get 503, running ones may finish for ``shutdown_timeout`` seconds,
    then the rest end with a final error (a chunk for streams), and the process exits 0 (uvicorn would
    re-raise the signal). A second SIGINT ends them all at once the same way and exits 130. An engine
    that stopped makes ``serve`` exit after a short grace period, when ``exit_on_engine_failure``.
    """

    def __init__(
        self,
        config: uvicorn.Config,
        supervisor: Supervisor,
        shutdown_timeout: float,
        exit_on_engine_failure: bool,
    ):
        super().__init__(config)
        self.supervisor = supervisor
        self.shutdown_timeout = shutdown_timeout
        self.exit_on_engine_failure = exit_on_engine_failure
        self.engine_failed = False  # the reason the server stopped, for run()'s exit status
        self.interrupted = False  # a second Ctrl-C ended the requests without waiting (exit 130)
        self._failure_seen_at: float | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            if sig == signal.SIGINT and not self.interrupted and self._loop is not None:
                self.interrupted = True
                self._loop.call_soon_threadsafe(self._end_requests)
            return
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        engine = self.supervisor.engine
        if engine is None:
            return
        engine.close_admission("the server is shutting down")
        pending, timeout = engine.num_pending, self.shutdown_timeout
        log.info("shutting down: %d requests may finish for up to %.0f s", pending, timeout)
        self._loop.call_later(self.shutdown_timeout, self._end_requests)

    def _end_requests(self) -> None:
        """Every request still running ends with a final error, one whose body is still arriving with a
        503; what has not finished once they had time to be sent is cancelled."""
        engine = self.supervisor.engine
        if engine is not None:
            engine.abort_all(ServiceUnavailable("the server shut down before this request finished"))
        if self.supervisor.stop_reading is not None:
            self.supervisor.stop_reading.set()
        # Then uvicorn cancels what is left.
        self._loop.call_later(FINAL_ERROR_S, setattr, self, "force_exit", True)

    async def on_tick(self, counter: int) -> bool:
        if self.supervisor.load_error is not None:
            return True
        engine = self.supervisor.engine
        if self.exit_on_engine_failure and engine is not None and engine.failure is not None:
            now = time.monotonic()
            if self._failure_seen_at is None:
                self._failure_seen_at = now
                grace = ENGINE_FAILURE_GRACE_SECONDS
                log.error("the engine has stopped (%s); exiting in %.0f s", engine.failure, grace)
            elif now - self._failure_seen_at >= ENGINE_FAILURE_GRACE_SECONDS:
                self.engine_failed = True
                return True
        return await super().on_tick(counter)
