"""``mlx-infer models``: the models on this machine, with size, architecture, quantization and fit."""

from __future__ import annotations

import argparse
import json

from mlx_infer import model_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help=f"also look for GGUF files and model folders under DIR (repeatable; default: the folders in "
        f"${model_store.MODELS_PATH_ENV})",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.table import Table

    found = model_store.list_models(args.dir)
    if args.json:
        print(json.dumps([m.as_json() for m in found], indent=2))
        return 0
    console = Console()
    if not found:
        console.print(
            "No models found. `mlx-infer pull ORG/NAME` downloads one; `--dir DIR` looks in a folder."
        )
        return 0
    budget = model_store.memory_budget()
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "ARCH", "QUANT", "SIZE", "FITS", "WHERE"):
        table.add_column(column, overflow="fold", justify="right" if column == "SIZE" else "left")
    for m in found:
        fits = "yes" if m.fits else "no"
        table.add_row(m.name, m.architecture, m.quantization, human_size(m.size), fits, m.where)
    console.print(table)
    console.print(
        f"[dim]fits: weights + {model_store.FIT_OVERHEAD:.0%} within {human_size(budget)} "
        f"({model_store.FIT_FRACTION:.0%} of this device's memory)[/dim]"
    )
    return 0
