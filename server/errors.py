"""OpenAI-style error responses: the one place typed errors become HTTP statuses."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError
from starlette.responses import JSONResponse

from mlx_infer.errors import ContextTooLong, MlxInferError, ModelNotFound, QueueFull


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


def describe(error: Exception) -> tuple[int, str, str, str | None]:
    """(HTTP status, one-line message, OpenAI error type, field at fault) of any error a route raises."""
    if isinstance(error, MlxInferError):
        return error.http_status, str(error), error.openai_type, error.param
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        return 400, f"{param}: {first['msg']}" if param else first["msg"], "invalid_request_error", param
    return 500, f"internal error: {type(error).__name__}", "server_error", None


def retry_after(error: Exception) -> dict[str, str] | None:
    """A Retry-After header for an error worth retrying: a full queue, or a 503 that says when."""
    seconds = 1 if isinstance(error, QueueFull) else getattr(error, "retry_after", None)  # ServiceUnavailable
    return None if seconds is None else {"Retry-After": str(seconds)}


def from_exception(error: Exception) -> JSONResponse:
    status, message, type_, param = describe(error)
    headers = retry_after(error)
    # OpenAI's codes for an unknown model and a prompt too long, which clients match on (agents trim
    # their history on context_length_exceeded).
    code = {ModelNotFound: "model_not_found", ContextTooLong: "context_length_exceeded"}.get(type(error))
    return error_response(status, message, type_, param=param, headers=headers, code=code)


# ---- Anthropic's error shape (the /v1/messages routes) -------------------------------------------
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error_body(status: int, message: str) -> dict:
    error_type = ANTHROPIC_ERROR_TYPES.get(status, "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def anthropic_error_response(
    status: int, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    return JSONResponse(anthropic_error_body(status, message), status_code=status, headers=headers)


def anthropic_from_exception(error: Exception) -> JSONResponse:
    """The statuses of ``from_exception`` in Anthropic's shape, except that a full queue is Anthropic's
    529 overloaded_error (its SDK retries that after Retry-After)."""
    if isinstance(error, QueueFull):
        return anthropic_error_response(529, str(error), headers={"Retry-After": "1"})
    status, message, _, _ = describe(error)
    return anthropic_error_response(status, message, headers=retry_after(error))


def anthropic_shaped(path: str, headers: Mapping[str, str]) -> bool:
    """Whether an answer takes Anthropic's shape: on its Messages routes, and on any other route for
    Anthropic's client, which sends ``anthropic-version`` with every request."""
    return path.startswith("/v1/messages") or "anthropic-version" in headers


def unauthorized(anthropic: bool = False) -> JSONResponse:
    """The 401 for a missing or wrong API key, in the shape of the route's API."""
    if anthropic:
        return anthropic_error_response(401, "invalid or missing API key (x-api-key or Bearer)")
    return error_response(401, "invalid or missing API key", "authentication_error")


def for_exception(error: Exception, anthropic: bool = False) -> JSONResponse:
    """``error`` as the route's API answers it: Anthropic's shape on /v1/messages, OpenAI's elsewhere."""
    return anthropic_from_exception(error) if anthropic else from_exception(error)
