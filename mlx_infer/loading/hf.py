"""Hugging Face / MLX model folders: ``config.json`` plus one or more safetensors files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_infer.errors import InvalidCheckpoint, ModelNotFound

INDEX_FILE = "model.safetensors.index.json"


def read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelNotFound(f"{folder}: no config.json (not a Hugging Face model folder)")
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise InvalidCheckpoint(f"{path}: unreadable config ({one_line(e)})") from None
    if not isinstance(config, dict):
        raise InvalidCheckpoint(f"{path}: config is not a JSON object")
    return config


def weight_files(folder: Path) -> list[Path]:
    """The safetensors files holding the weights: those the index names, else every ``*.safetensors``."""
    index = folder / INDEX_FILE
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise InvalidCheckpoint(f"{index}: unreadable index ({one_line(e)})") from None
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise InvalidCheckpoint(f"{folder}: shard {missing[0]} named in {INDEX_FILE} is missing")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise InvalidCheckpoint(f"{folder}: no *.safetensors weights")
    return files


def read_weights(folder: Path) -> dict[str, mx.array]:
    """All tensors of the folder, loaded lazily: ``mx.load`` maps the file, nothing is read until used."""
    weights: dict[str, mx.array] = {}
    for path in weight_files(folder):
        try:
            weights.update(mx.load(str(path)))
        except (RuntimeError, ValueError, OSError) as e:
            raise InvalidCheckpoint(f"{path.name}: {one_line(e)}") from None
    return weights


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
