"""What a request asks its output to match: a JSON schema, any JSON object, a regex, one of some strings,
or a grammar (Lark, or GBNF as llama.cpp users write it)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal, get_args

from mlx_infer.errors import InvalidRequest

ConstraintKind = Literal["json_schema", "json_object", "regex", "choice", "lark", "gbnf"]
KINDS: tuple[str, ...] = get_args(ConstraintKind)


@dataclass(frozen=True)
class ConstraintSpec:
    """``value``: a schema (dict, or its JSON text) for "json_schema", ignored for "json_object", a pattern
    for "regex", a list of strings for "choice", grammar text for "lark" and "gbnf".

    Equal specs hash alike, so compiled grammars are cached by spec. A schema's key order is part of it:
    the output writes an object's properties in the order its schema lists them (as OpenAI's structured
    outputs do, so a "reasoning" property listed first is written before the "answer")."""

    kind: ConstraintKind
    value: Any = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequest(f"unknown constraint kind {self.kind!r} (one of {', '.join(KINDS)})")
        if self.kind == "json_schema" and not isinstance(self.value, dict | str | bool):
            raise InvalidRequest("a JSON schema must be an object")
        if self.kind in ("regex", "lark", "gbnf") and not (isinstance(self.value, str) and self.value):
            raise InvalidRequest(f"a {self.kind} constraint needs a non-empty string")
        if self.kind == "choice" and not (
            isinstance(self.value, list | tuple)
            and self.value
            and all(isinstance(c, str) for c in self.value)
        ):
            raise InvalidRequest("a choice constraint needs a non-empty list of strings")

    def key(self) -> str:
        """The text of the spec: equal for equal specs."""
        value = self.value
        if self.kind == "json_schema" and isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise InvalidRequest(f"the JSON schema is not valid JSON: {e}") from None
        if isinstance(value, tuple):
            value = list(value)
        return json.dumps([self.kind, value], ensure_ascii=False)

    def __hash__(self) -> int:
        return hash(self.key())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ConstraintSpec) and self.key() == other.key()
