"""``POST /v1/embeddings``: OpenAI's embeddings API over an ``AsyncEmbedder``.

``input`` is a string, a list of strings, a list of token ids or a list of token-id lists (at most
MAX_INPUTS); ``encoding_format`` float or base64 (little-endian float32, as OpenAI sends it);
``dimensions`` cuts Matryoshka-trained embeddings (``EmbeddingModel.resize``). A server of a generation
model registers the route too and answers it with a 400 that says why.
"""

from __future__ import annotations

import base64
from typing import Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, field_validator
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from mlx_infer.embedding_engine import AsyncEmbedder
from mlx_infer.errors import InvalidRequest

MAX_INPUTS = 2048  # OpenAI's limit of inputs per request
_INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of token-id lists"


def _is_token(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


class EmbeddingRequest(BaseModel):
    # Unknown fields (user, ...) are accepted and ignored, as on the other routes.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None  # the served model when left out (a server of one model)
    input: Any
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)

    @field_validator("input")
    @classmethod
    def _input_shape(cls, value: Any) -> str | list[str] | list[list[int]]:
        """The input as given, refused unless it has one of the four shapes and nothing in it is empty."""
        if isinstance(value, str):
            if not value:
                raise ValueError("must not be an empty string")
            return value
        if not isinstance(value, list) or not value:
            raise ValueError(f"must be {_INPUT_SHAPES} (non-empty)")
        if all(_is_token(t) for t in value):
            return [value]
        if len(value) > MAX_INPUTS:
            raise ValueError(f"has {len(value)} inputs; at most {MAX_INPUTS} are allowed")
        if all(isinstance(s, str) for s in value):
            if not all(value):
                raise ValueError("must not contain empty strings")
            return value
        if all(isinstance(ids, list) and ids and all(_is_token(t) for t in ids) for ids in value):
            return value
        raise ValueError(f"must be {_INPUT_SHAPES}, each non-empty")


class EmbeddingRoutes:
    """The embeddings route of an ``OpenAIServer``; ``embedder`` is None on a generation model's server."""

    def __init__(self, server, embedder: AsyncEmbedder | None = None):
        self.server = server
        self.embedder = embedder

    def routes(self) -> list[Route]:
        return [Route("/v1/embeddings", self.server.guarded(self.create), methods=["POST"])]

    async def create(self, request: Request) -> Response:
        if self.embedder is None:
            raise InvalidRequest(
                f"the model {self.server.config.model_name!r} generates text and computes no embeddings; "
                "name an embedding model (/v1/models lists this server's) or serve one",
                param="model",
            )
        body: EmbeddingRequest = await self.server._body(request, EmbeddingRequest)
        model = self.embedder.model
        model.check_dimensions(body.dimensions)
        texts = [body.input] if isinstance(body.input, str) else body.input
        if isinstance(texts[0], str):
            # Tokenizing 2048 long texts takes a while: off the loop that answers every other request.
            inputs = await run_in_threadpool(model.tokenize, texts)
        else:
            inputs = texts
        model.check(inputs)
        vectors = model.resize(await self.embedder.embed(inputs), body.dimensions)
        encode = _base64 if body.encoding_format == "base64" else _floats
        data = [{"object": "embedding", "index": i, "embedding": encode(v)} for i, v in enumerate(vectors)]
        tokens = sum(len(ids) for ids in inputs)
        return JSONResponse(
            {
                "object": "list",
                "data": data,
                "model": body.model,
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            }
        )


def _floats(vector: np.ndarray) -> list[float]:
    return vector.tolist()


def _base64(vector: np.ndarray) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")
