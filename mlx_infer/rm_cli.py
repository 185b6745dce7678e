"""``mlx-infer rm NAME``: delete a model from the Hugging Face cache or mlx-infer's cache."""

from __future__ import annotations

import argparse

from mlx_infer import model_store
from mlx_infer.models_cli import human_size


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="a repo id or path, as `mlx-infer models` lists it")


def run(args: argparse.Namespace) -> int:
    deleted, freed = model_store.remove(args.name)
    print(f"deleted {deleted}, {human_size(freed)} freed")
    return 0
