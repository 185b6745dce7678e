"""Structured-output fields of a request -> one ConstraintSpec.

Accepts what clients send to OpenAI (``response_format``), to vLLM (``guided_json``, ``guided_regex``,
``guided_choice``, ``guided_grammar`` and the newer ``structured_outputs``) and to llama.cpp's server
(``json_schema``, ``grammar`` in GBNF, ``response_format`` with a ``schema``). At most one may be given.
Grammars are Lark or GBNF: llguidance tells them apart.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import BaseModel

from mlx_infer.constraints import ConstraintSpec
from mlx_infer.errors import InvalidRequest


class StructuredOutputFields(BaseModel):
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    json_schema: dict[str, Any] | None = None
    grammar: str | None = None

    def constraint(self) -> ConstraintSpec | None:
        """The request's constraint, or None; InvalidRequest (a 400 naming the field) when a field is
        malformed or more than one asks for a constraint."""
        found = self._constraints()
        return found[0][1] if found else None

    def constraint_field(self) -> str | None:
        """The field the constraint came from (for an error when it does not compile), or None."""
        found = self._constraints()
        return found[0][0] if found else None

    def _constraints(self) -> list[tuple[str, ConstraintSpec]]:
        found: list[tuple[str, ConstraintSpec]] = []
        if self.response_format is not None:
            spec = _response_format(self.response_format)
            if spec is not None:
                found.append(("response_format", spec))
        simple = [
            ("guided_json", "json_schema", self.guided_json),
            ("guided_regex", "regex", self.guided_regex),
            ("guided_choice", "choice", self.guided_choice),
            ("guided_grammar", "gbnf", self.guided_grammar),
            ("json_schema", "json_schema", self.json_schema),
            ("grammar", "gbnf", self.grammar),
        ]
        found += [(name, _spec(name, kind, value)) for name, kind, value in simple if value is not None]
        if self.structured_outputs is not None:
            found += _structured_outputs(self.structured_outputs)
        if len(found) > 1:
            names = ", ".join(name for name, _ in found)
            raise InvalidRequest(f"give one output constraint, not several ({names})", param=found[1][0])
        return found


def _spec(param: str, kind: str, value: Any) -> ConstraintSpec:
    if kind == "json_schema" and isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise InvalidRequest(f"{param} is not valid JSON: {e}", param=param) from None
    try:
        return ConstraintSpec(kind, value)  # type: ignore[arg-type]
    except InvalidRequest as e:
        raise InvalidRequest(f"{param}: {e}", param=param) from None


# A json_schema format's name, as OpenAI takes it (response_format here, text.format on /v1/responses).
SCHEMA_NAME_PATTERN = r"^[a-zA-Z0-9_-]{1,64}$"


def _response_format(fmt: dict[str, Any]) -> ConstraintSpec | None:
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        # llama.cpp's server takes a schema here too.
        schema = fmt.get("schema")
        return _spec("response_format", "json_object" if schema is None else "json_schema", schema)
    if kind == "json_schema":
        body = fmt.get("json_schema")
        if not isinstance(body, dict):
            raise InvalidRequest("response_format.json_schema must be an object", param="response_format")
        name = body.get("name")
        if not (isinstance(name, str) and re.fullmatch(SCHEMA_NAME_PATTERN, name)):
            # As OpenAI and vLLM require it (the Responses route's text.format too).
            raise InvalidRequest(
                "response_format.json_schema.name is required: 1 to 64 letters, digits, _ or -",
                param="response_format.json_schema.name",
            )
        schema = body.get("schema")
        if schema is None:
            return _spec("response_format", "json_object", None)
        return _spec("response_format.json_schema.schema", "json_schema", schema)
    raise InvalidRequest(
        f"response_format.type must be text, json_object or json_schema, not {kind!r}",
        param="response_format",
    )


def json_schema_constraint(param: str, schema: dict[str, Any]) -> ConstraintSpec:
    """A schema some request field holds (Anthropic's ``output_config.format.schema``) as a constraint."""
    return _spec(param, "json_schema", schema)


def text_format_constraint(kind: str, schema: dict[str, Any] | None) -> ConstraintSpec | None:
    """The Responses API's ``text.format`` (flat: type, name, schema, strict) as a constraint."""
    if kind == "text":
        return None
    if kind == "json_object":
        return _spec("text.format", "json_object", None)
    if schema is None:
        raise InvalidRequest("text.format: a json_schema format needs its schema", param="text.format.schema")
    return _spec("text.format.schema", "json_schema", schema)


_STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "gbnf"}


def _structured_outputs(fields: dict[str, Any]) -> list[tuple[str, ConstraintSpec]]:
    found = []
    for key, value in fields.items():
        if value is None or value is False:
            continue
        name = f"structured_outputs.{key}"
        if key == "json_object":
            found.append((name, _spec(name, "json_object", None)))
        elif key in _STRUCTURED_OUTPUTS:
            found.append((name, _spec(name, _STRUCTURED_OUTPUTS[key], value)))
        elif key not in (
            "disable_fallback",
            "disable_any_whitespace",
            "disable_additional_properties",
            "whitespace_pattern",
        ):
            raise InvalidRequest(f"{name} is not supported", param="structured_outputs")
    return found
