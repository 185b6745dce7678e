"""``mlx-infer models``: the models on this machine, with size, architecture, quantization and fit."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlx_infer import model_store
from mlx_infer.errors import InvalidRequest


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dir",
        action="append",
        default=[],
        metavar="DIR",
        help="also look for GGUF files and model folders under DIR (repeatable); the folders in "
        f"${model_store.MODELS_PATH_ENV} are searched too",
    )
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def run(args: argparse.Namespace) -> int:
    from rich.table import Table

    from mlx_infer.plan.planner import human_bytes, memory_budget
    from mlx_infer.terminal import StdoutConsole

    for folder in args.dir:  # one the user typed (those of the environment variable may come and go)
        if not Path(folder).expanduser().is_dir():
            raise InvalidRequest(f"--dir {folder}: no such folder")
    problems: list[str] = []
    found = model_store.list_models(args.dir, check_fit=False, problems=problems)
    for line in problems:  # corrupt or partial downloads in the Hugging Face cache: not listed
        print(f"mlx-infer models: warning: {line}", file=sys.stderr)
    budget, budget_source = memory_budget()
    fit_texts = {m.path: _check_fit(m, budget) for m in found}
    if args.json:
        print(json.dumps([{**m.as_json(), **fit_texts[m.path][1]} for m in found], indent=2))
        return 0
    # Piped (grep, a file): one row a line, names whole; rich would wrap them at 80 columns.
    console = StdoutConsole() if sys.stdout.isatty() else StdoutConsole(width=1_000_000)
    if not found:
        console.print(
            "No models found. `mlx-infer pull ORG/NAME` downloads one; `--dir DIR` looks in a folder."
        )
        return 0
    table = Table(box=None, header_style="bold")
    for column in ("NAME", "ARCH", "QUANT", "SIZE", "FITS", "WHERE"):
        table.add_column(column, overflow="fold", justify="right" if column == "SIZE" else "left")
    for m in found:
        table.add_row(
            m.name, m.architecture, m.quantization, human_size(m.size), fit_texts[m.path][0], m.where
        )
    console.print(table)
    console.print(
        f"[dim]fits: weights as held here, one sequence's KV cache at the model's context and scratch, "
        f"within {human_bytes(budget)} ({budget_source}); `mlx-infer plan -m NAME` for the details[/dim]"
    )
    return 0


def _check_fit(m: model_store.LocalModel, budget: int) -> tuple[str, dict[str, int | None]]:
    """(FITS column, extra JSON keys) from the memory planner; sets ``m.fits``. A model the planner cannot
    read (an encoder, an odd config) is judged by its size on disk, with a question mark."""
    from mlx_infer.errors import InvalidCheckpoint, MlxInferError, UnreadableWeights
    from mlx_infer.plan import make_plan

    try:
        plan = make_plan(m.path)
    except (MlxInferError, OSError, ValueError) as e:
        # A truncated or corrupt file: its header, or the weights' (a config the planner does not know
        # is judged by size).
        if isinstance(e, UnreadableWeights) or (isinstance(e, InvalidCheckpoint) and m.architecture == "?"):
            m.fits = False
            return "unreadable", {"max_context_that_fits": None, "planned_bytes": None}
        m.fits = model_store.fits(m.size, budget)
        return ("yes?" if m.fits else "no?"), {"max_context_that_fits": None, "planned_bytes": None}
    m.fits = plan.fits
    if plan.fits:
        text = "yes"
    elif plan.weights_fit and plan.max_context_that_fits:
        text = f"ctx {plan.max_context_that_fits}"
    else:
        text = "no"
    return text, {"max_context_that_fits": plan.max_context_that_fits, "planned_bytes": plan.total_bytes}
