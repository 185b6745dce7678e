"""OpenAI-style error responses: the one place typed errors become HTTP statuses."""

from __future__ import annotations

from pydantic import ValidationError
from starlette.responses import JSONResponse

from mlx_infer.errors import MlxInferError, QueueFull


def error_response(
    status: int,
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    body = {"error": {"message": message, "type": type_, "param": param, "code": None}}
    return JSONResponse(body, status_code=status, headers=headers)


def from_exception(error: Exception) -> JSONResponse:
    if isinstance(error, QueueFull):
        return error_response(429, str(error), error.openai_type, headers={"Retry-After": "1"})
    if isinstance(error, MlxInferError):
        return error_response(error.http_status, str(error), error.openai_type, param=error.param)
    if isinstance(error, ValidationError):
        first = error.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        return error_response(400, f"{param}: {first['msg']}" if param else first["msg"], param=param)
    return error_response(500, f"internal error: {type(error).__name__}", "server_error")
