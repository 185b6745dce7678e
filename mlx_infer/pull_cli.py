"""``mlx-infer pull ORG/NAME``: download a model from the Hugging Face Hub, with a progress bar per file."""

from __future__ import annotations

import argparse

from mlx_infer import model_store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "repo_id", metavar="REPO_ID", help="a Hugging Face model repo id, e.g. Qwen/Qwen3-0.6B"
    )
    parser.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    parser.add_argument(
        "--include",
        action="append",
        default=None,
        metavar="PATTERN",
        help="download only the files matching this glob (repeatable; default: config, tokenizer and "
        "safetensors files, or the repo's only GGUF file)",
    )


def rich_bars(progress):
    """A ``tqdm_class`` for huggingface-hub that draws each file's bar in ``progress`` (rich)."""

    class FileBar:
        def __init__(self, *args, desc: str = "", total: int | None = None, initial: int = 0, **kwargs):
            self.task = progress.add_task(desc, total=total, completed=initial)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.close()

        def update(self, n: int | float | None = 1) -> None:
            progress.advance(self.task, n or 0)

        def close(self) -> None:
            pass

    return FileBar


def run(args: argparse.Namespace) -> int:
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        Progress,
        TextColumn,
        TimeRemainingColumn,
        TransferSpeedColumn,
    )

    from mlx_infer.cli_options import stderr_console

    console = stderr_console()
    columns = (
        TextColumn("{task.description}"),
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
    )
    # Bars only on a terminal: a log gets no redraws, and an error before any bar stays its one line.
    with Progress(*columns, console=console, disable=not console.is_terminal) as progress:
        folder = model_store.pull(args.repo_id, args.revision, args.include, tqdm_class=rich_bars(progress))
    print(folder)
    console.print(f"[dim]serve it: mlx-infer serve -m {args.repo_id}[/dim]")
    return 0
