"""``--json-schema FILE`` and ``--grammar FILE`` of ``mlx-infer generate``."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from mlx_infer.constraints.spec import ConstraintSpec
from mlx_infer.errors import InvalidRequest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("structured output")
    g.add_argument(
        "--json-schema",
        type=Path,
        default=None,
        metavar="FILE",
        help="answer with JSON valid against this schema",
    )
    g.add_argument(
        "--grammar",
        type=Path,
        default=None,
        metavar="FILE",
        help="answer in this grammar: Lark (llguidance's dialect), or GBNF if FILE ends in .gbnf",
    )


def from_args(args: argparse.Namespace) -> ConstraintSpec | None:
    """The constraint the flags ask for; InvalidRequest (one line) for an unreadable or malformed file."""
    if args.json_schema is not None and args.grammar is not None:
        raise InvalidRequest("give --json-schema or --grammar, not both")
    if args.json_schema is not None:
        text = _read(args.json_schema)
        try:
            schema = json.loads(text)
        except ValueError as e:
            raise InvalidRequest(f"{args.json_schema} is not valid JSON: {e}") from None
        return ConstraintSpec("json_schema", schema)
    if args.grammar is not None:
        kind = "gbnf" if args.grammar.suffix.lower() == ".gbnf" else "lark"
        return ConstraintSpec(kind, _read(args.grammar))
    return None


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read {path}: {getattr(e, 'strerror', None) or e}") from None
