"""Typed errors of mlx-infer.

Each error carries the CLI exit code and the HTTP status it maps to, so the CLI and the
server translate errors in one place each (``cli.main`` and ``server.errors``).
"""

from __future__ import annotations


class MlxInferError(Exception):
    """Base class: a user-facing error whose message is one line.

    ``param`` names the request field at fault, when there is one (OpenAI's ``error.param``).
    """

    exit_code = 1
    http_status = 500
    openai_type = "server_error"

    def __init__(self, message: str = "", param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelNotFound(MlxInferError):
    exit_code = 2
    http_status = 404
    openai_type = "invalid_request_error"


class UnsupportedArchitecture(MlxInferError):
    exit_code = 3
    http_status = 400
    openai_type = "invalid_request_error"


class InvalidCheckpoint(MlxInferError):
    """A truncated file, a wrong dtype, a missing tensor: the checkpoint cannot be used."""

    exit_code = 4
    http_status = 500


class UnreadableWeights(InvalidCheckpoint):
    """A weight file whose header cannot be read: a download cut short, a corrupt file."""


class InvalidRequest(MlxInferError):
    exit_code = 2
    http_status = 400
    openai_type = "invalid_request_error"


class ContextTooLong(InvalidRequest):
    """A prompt (plus what must be generated) does not fit the model's context or the KV pool."""


class ModelTooLarge(InvalidRequest):
    """A model whose weights alone exceed this machine's memory budget (mlx_infer.plan)."""


class RequestTooLarge(InvalidRequest):
    """A request body over the server's byte limit, refused before it is parsed."""

    http_status = 413


class RequestTimeout(InvalidRequest):
    """A request body that did not arrive in time."""

    http_status = 408


class RequestFailed(MlxInferError):
    """Something went wrong inside the engine for this one request; the engine goes on with the others."""


class ConstraintFailed(RequestFailed):
    """A request's output constraint could not be followed (a schema no output satisfies, a grammar past
    llguidance's limits): the request's fault, so a 400, though only found while generating."""

    http_status = 400
    openai_type = "invalid_request_error"


class ServiceUnavailable(MlxInferError):
    """The server cannot take requests now: the model is loading, the server is shutting down, or the
    engine has stopped. ``retry_after``: seconds after which a retry may succeed (the 503's Retry-After),
    when that is known."""

    http_status = 503

    def __init__(self, message: str, retry_after: int | None = None):
        super().__init__(message)
        self.retry_after = retry_after


class EngineFailure(ServiceUnavailable):
    """The engine thread stopped; the process should be restarted (``serve`` exits with this code)."""

    exit_code = 7


class QueueFull(MlxInferError):
    exit_code = 5
    http_status = 429
    openai_type = "rate_limit_error"


class DistributedError(MlxInferError):
    exit_code = 6


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised (``cli.main``) where the work then cleans up as after Ctrl-C; the exit is 143."""
