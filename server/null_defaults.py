"""A null where a request schema has a default means that default.

OpenAI documents most optional parameters as "number or null" / "boolean or null", and its clients send
``null`` for a value an app left as ``None`` (``temperature=config.get("temperature")``); vLLM takes that
as the default. Pydantic would refuse it for a field typed ``float`` with a default of 1.0.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, model_validator


class NullMeansDefault(BaseModel):
    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        return {key: value for key, value in data.items() if value is not None or not cls._has_default(key)}

    @classmethod
    def _has_default(cls, key: str) -> bool:
        field = cls.model_fields.get(key)
        return field is not None and not field.is_required() and field.default is not None
