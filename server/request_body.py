"""A JSON request body read safely, for every API surface.

Size and nesting depth are bounded before anything is parsed (``json.loads`` recurses: a body nested
10,000 deep raises RecursionError), then one pydantic schema validates the fields. Every failure is a
typed error naming the field where there is one (400, 408 or 413); each surface renders it in its own
error shape, so the OpenAI routes and any later ones (Anthropic Messages, Responses, embeddings) refuse
a hostile body the same way.
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from mlx_infer.errors import InvalidRequest, RequestTimeout, RequestTooLarge, ServiceUnavailable
from mlx_infer.user_text import checked_text

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
MAX_NESTING_DEPTH = 64  # arrays and objects; a JSON schema of tools nests well under this
BODY_TIMEOUT_SECONDS = 60.0  # for the whole body to arrive once the headers have
# The request-state key of an asyncio.Event set when the server stops waiting for bodies (shutdown).
STOP_READING = "mlx_infer_stop_reading"
PARSE_INLINE_BYTES = 64 * 2**10  # larger bodies are parsed on a worker thread, off the event loop

Schema = TypeVar("Schema", bound=BaseModel)

# A JSON string, escapes included; what remains once strings are cut out is structure and scalars.
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = np.zeros(256, dtype=np.int8)  # depth change per byte value
_STEP[list(b"[{")] = 1
_STEP[list(b"]}")] = -1


async def read_body(request: Request, max_bytes: int) -> bytes:
    """The raw body, refused (413) as soon as it is known to exceed ``max_bytes``: from its
    Content-Length before reading, or while reading a body sent without one."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise RequestTooLarge(
            f"the request body has {int(declared)} bytes; this server takes at most {max_bytes}"
        )

    async def receive() -> bytes:
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > max_bytes:
                raise RequestTooLarge(f"the request body exceeds {max_bytes} bytes")
            chunks.append(chunk)
        return b"".join(chunks)

    reading = asyncio.ensure_future(receive())
    stop = getattr(request.state, STOP_READING, None)
    stopped = asyncio.ensure_future(stop.wait()) if stop is not None else None
    try:
        done, _ = await asyncio.wait(
            [reading] + ([stopped] if stopped else []),
            timeout=BODY_TIMEOUT_SECONDS,
            return_when=asyncio.FIRST_COMPLETED,
        )
    finally:
        for task in (reading, stopped):
            if task is not None and not task.done():
                task.cancel()
    if reading in done:
        return reading.result()
    if stopped is not None and stopped in done:
        raise ServiceUnavailable("the server shut down before this request's body arrived")
    raise RequestTimeout(f"the request body did not arrive within {BODY_TIMEOUT_SECONDS:.0f} s")


def nesting_depth(raw: bytes) -> int:
    """How deep arrays and objects nest in ``raw`` (brackets inside strings do not count), exactly when
    it could exceed MAX_NESTING_DEPTH; below that, an upper bound (the number of opening brackets)."""
    bound = raw.count(b"[") + raw.count(b"{")
    if bound <= MAX_NESTING_DEPTH:
        return bound
    steps = _STEP[np.frombuffer(_STRING.sub(b"", raw), dtype=np.uint8)]
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object from raw bytes (UTF-8/16/32), depth-checked before parsing."""
    depth = nesting_depth(raw)
    if depth > MAX_NESTING_DEPTH:
        raise InvalidRequest(
            f"the request body nests {depth} levels deep; at most {MAX_NESTING_DEPTH} are allowed"
        )
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise InvalidRequest("the request body is not valid JSON") from None
    except ValueError:  # Python refuses to convert integers of over 4300 digits
        raise InvalidRequest("the request body has a number with too many digits") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):  # JSON may spell half an emoji (a string cut between its two halves)
        _refuse_lone_surrogates(body, [])
    return body


# A \uD800-\uDFFF escape: a pair of them is one character, json.loads keeps an unpaired one as is.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _refuse_lone_surrogates(value: Any, path: list[str]) -> None:
    """InvalidRequest naming the first string (or key) holding an unpaired UTF-16 surrogate: no tokenizer
    can encode it, and it is no character to answer about."""
    if isinstance(value, str):
        param = ".".join(path) or None
        checked_text(value, param or "a key of the request body", param)
    elif isinstance(value, dict):
        for key, item in value.items():
            _refuse_lone_surrogates(key, path)
            _refuse_lone_surrogates(item, [*path, key])
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_lone_surrogates(item, [*path, str(i)])


# A union member pydantic names in an error's location: a type ("str", "list[int]") or a model's class
# (CamelCase: the API's own fields are snake_case).
_UNION_MEMBER = re.compile(r"^(str|int|float|bool|none|[\w-]+\[.*\]|[A-Z]\w*)$")


def validate(schema: type[Schema], body: dict[str, Any]) -> Schema:
    """``body`` as ``schema``; the first invalid field becomes an InvalidRequest that names it."""
    try:
        return schema.model_validate(body)
    except ValidationError as e:
        errors = e.errors(include_url=False)
        # Of a union's failed members, the one that got furthest into the value says what is wrong
        # (an item's missing field, not "should be a valid string"); the first of those otherwise.
        first = max(errors, key=lambda err: len(err["loc"]))
        # A union's error names the member type it tried ("prompt.str"): the client's field is "prompt".
        param = ".".join(str(p) for p in first["loc"] if not _UNION_MEMBER.match(str(p))) or None
        message = first["msg"].removeprefix("Value error, ")  # pydantic's prefix to our validators' own words
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param) from None


async def read_json(request: Request, schema: type[Schema], max_bytes: int) -> Schema:
    raw = await read_body(request, max_bytes)
    # A body of megabytes takes a second to check and parse: not on the loop that feeds every stream.
    body = parse_object(raw) if len(raw) <= PARSE_INLINE_BYTES else await run_in_threadpool(parse_object, raw)
    return validate(schema, body)
