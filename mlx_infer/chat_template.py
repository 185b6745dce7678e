"""Chat templates rendered exactly as Hugging Face transformers renders them.

Templates come from model files, so they are untrusted code: they run in jinja2's immutable sandbox with
the environment transformers builds (``trim_blocks``, ``lstrip_blocks``, loop controls, its ``tojson``,
``raise_exception``, ``strftime_now``, ``dict`` and an underscore-proof ``namespace``). Matching
transformers byte for byte matters because the rendered text is what the model was trained on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.exceptions
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from mlx_infer.errors import InvalidCheckpoint, InvalidRequest

# Names a message's reasoning may come under; templates read the first (transformers aliases them too).
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` renders its body unchanged.

    transformers uses the tag to track assistant tokens for training masks; templates that contain it must
    still compile here.
    """

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # transformers' override: jinja's own filter escapes HTML characters, which templates must not see.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """A namespace that refuses underscore names, so templates cannot reach CPython internals through it."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja's signature trick, keeps namespace(self=..)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set underscore attribute {name!r}")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile once per template text; a template that does not parse is a broken model file."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise InvalidCheckpoint(f"chat template does not parse: {e.message} (line {e.lineno})") from e


def _plain(value: Any) -> Any:
    """Rebuild template inputs from plain JSON types, so templates never see objects with risky methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value)
    if callable(getattr(value, "model_dump", None)):  # pydantic messages (server schemas, OpenAI SDK)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalize_messages(messages: Any) -> list[dict]:
    out = []
    for message in _plain(list(messages)):
        if not isinstance(message, dict):
            raise InvalidRequest(f"chat messages must be objects with a role, got {message!r}")
        # OpenAI clients send content=None / tool_calls=None; templates handle a missing key, not None.
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next((message[k] for k in _REASONING_FIELDS if k in message), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        if isinstance(message.get("tool_calls"), list):
            message["tool_calls"] = [_call_with_object_arguments(c) for c in message["tool_calls"]]
        out.append(message)
    return out


def _call_with_object_arguments(call: Any) -> Any:
    """OpenAI clients send a call's ``arguments`` as JSON text; templates expect the object (transformers
    documents a dict, and templates ``tojson`` it), so the text is parsed as vLLM does."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
        return call
    try:
        arguments = json.loads(function["arguments"])
    except ValueError:
        return call
    if not isinstance(arguments, dict):
        return call
    return {**call, "function": {**function, "arguments": _Arguments(arguments)}}


class _Arguments(dict):
    """Call arguments as the object templates expect, that still joins strings as its JSON text: the
    DeepSeek V3 / R1 / V3.1 templates write ``'<｜tool▁sep｜>' + tool['function']['arguments']``."""

    def __add__(self, other: Any) -> Any:
        return _tojson(self) + other if isinstance(other, str) else NotImplemented

    def __radd__(self, other: Any) -> Any:
        return other + _tojson(self) if isinstance(other, str) else NotImplemented


def select_template(templates: str | Mapping[str, str] | None, tools: list | None) -> str:
    """The template to use: named templates pick ``tool_use`` when tools are given, else ``default``."""
    if templates is None:
        raise InvalidRequest("this model has no chat template; send a plain prompt (completions) instead")
    if isinstance(templates, str):
        return templates
    if tools and "tool_use" in templates:
        return templates["tool_use"]
    if "default" in templates:
        return templates["default"]
    raise InvalidRequest(f"this model has named chat templates {sorted(templates)} but none called 'default'")


def render_chat(
    template: str,
    messages: Any,
    *,
    special_tokens: Mapping[str, str],
    add_generation_prompt: bool = True,
    tools: list | None = None,
    documents: list | None = None,
    **kwargs: Any,
) -> str:
    """Render ``messages`` the way ``transformers.apply_chat_template(..., tokenize=False)`` does.

    ``special_tokens`` (``bos_token``, ``eos_token``, ...) are template variables; ``kwargs`` override them.
    Template errors, including ``raise_exception(...)`` and sandbox violations, become ``InvalidRequest``.
    """
    if not messages:
        raise InvalidRequest("cannot apply a chat template to an empty conversation")
    if tools is not None and not all(isinstance(t, Mapping) for t in tools):
        raise InvalidRequest("tools must be JSON schema objects")
    compiled = compile_template(template)
    variables = _plain({**special_tokens, **kwargs})
    try:
        return compiled.render(
            messages=_normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
            **variables,
        )
    except jinja2.exceptions.TemplateError as e:
        raise InvalidRequest(f"chat template error: {e.message or type(e).__name__}") from e
