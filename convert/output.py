"""The output folder: atomic creation, safetensors shards with their index, config.json, tokenizer files.

The layout is mlx-lm's (``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` plus
``model.safetensors.index.json``), so mlx-lm and mlx-community tooling load the result too.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx

from mlx_infer.errors import InvalidRequest, MlxInferError

from .weights import Group

MAX_SHARD_BYTES = 5 * 10**9  # mlx-lm's limit; one tensor larger than this gets a shard of its own
INDEX_FILE = "model.safetensors.index.json"
# Files of a Hugging Face folder that describe the tokenizer and generation defaults: copied as they are.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt",
    "added_tokens.json",
    "tiktoken.model", "tokenization_kimi.py",  # Kimi's tokenizer (the .py for mlx-lm, which runs it)
)


def check_target(out: Path, force: bool) -> None:
    """Refuse, before any work, an existing output without --force, one that is not a model folder (what
    --force replaces is deleted: never a folder of other things), the folder this process works in (or
    one above it), and a place that cannot be written."""
    cwd = Path.cwd().resolve()
    if out.resolve() == cwd or out.resolve() in cwd.parents:
        raise InvalidRequest(f"--out {out} is the folder you are in (or above it): name a new one")
    if out.exists() and not force:
        raise InvalidRequest(f"{out} already exists (pass --force to replace it)")
    if out.exists() and not out.is_dir():
        raise InvalidRequest(f"{out} exists and is not a folder")
    if out.exists() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise InvalidRequest(f"{out} is not a model folder (no config.json): --force replaces only those")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".check", dir=out.parent)).rmdir()
    except OSError as e:
        raise InvalidRequest(f"cannot write to {out.parent}: {e.strerror or e}") from None


def check_not_source(out: Path, source: Path) -> None:
    """--force must not replace the folder the weights are read from, nor write a model inside it."""
    out, source = out.resolve(), source.resolve()
    if out == source or out in source.parents:
        raise InvalidRequest(f"--out {out} would overwrite the source model")
    if source.is_dir() and source in out.parents:
        raise InvalidRequest(f"--out {out} is inside the source model's folder {source}")


@contextlib.contextmanager
def atomic_folder(out: Path, force: bool) -> Iterator[Path]:
    """A temporary folder beside ``out`` that becomes ``out`` when the block succeeds and is removed
    when it fails or is interrupted: ``out`` is never seen half-written."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_partials(out)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    except OSError as e:
        raise InvalidRequest(f"cannot write to {out.parent}: {e.strerror or e}") from None
    try:
        yield tmp
        # mkdtemp's folder is private (0700); the model folder gets the mode mkdir would give it.
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        _replace(tmp, out, force)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


STALE_PARTIAL_S = 600  # a partial folder nothing has written to for this long belongs to no live convert


def _remove_stale_partials(out: Path) -> None:
    """Remove what a killed convert (SIGKILL, a crash) left of ``out``: hidden partial folders beside it
    in which nothing changed for STALE_PARTIAL_S (a running convert writes its files continuously)."""
    now = time.time()
    for partial in out.parent.glob(f".{glob.escape(out.name)}.*.partial"):
        try:
            changed = max([partial.stat().st_mtime] + [f.stat().st_mtime for f in partial.iterdir()])
        except OSError:
            continue
        if now - changed > STALE_PARTIAL_S:
            shutil.rmtree(partial, ignore_errors=True)


def _replace(tmp: Path, out: Path, force: bool) -> None:
    if not out.exists():
        tmp.rename(out)
        return
    if not force:  # created meanwhile
        raise InvalidRequest(f"{out} already exists (pass --force to replace it)")
    old = out.with_name(f".{out.name}.{tmp.name}.old")
    out.rename(old)
    try:
        tmp.rename(out)
    except OSError:
        old.rename(out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def plan_shards(groups: list[Group], max_bytes: int | None = None) -> list[list[Group]]:
    """Consecutive groups packed into shards of at most ``max_bytes`` (a layer is never split)."""
    limit = MAX_SHARD_BYTES if max_bytes is None else max_bytes
    shards: list[list[Group]] = []
    size = 0
    for g in groups:
        if not shards or size + g.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(g)
        size += g.nbytes
    return shards


def write_weights(
    folder: Path,
    shards: list[list[Group]],
    on_group: Callable[[Group], None],
    on_shard: Callable[[int], None],
) -> dict[str, Any]:
    """Evaluate and save shard by shard; return the index. ``shards`` is emptied as it goes so that a
    written shard's arrays are freed before the next one is computed."""
    n = len(shards)
    weight_map: dict[str, str] = {}
    total_size = total_params = 0
    for i in range(n):
        shard, shards[i] = shards[i], []
        name = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        tensors: dict[str, mx.array] = {}
        for g in shard:
            mx.eval(*g.tensors.values())  # quantize this layer now, so progress follows the work
            tensors.update(g.tensors)
            total_size += g.nbytes
            total_params += g.n_params
            on_group(g)
        try:
            mx.save_safetensors(str(folder / name), tensors, metadata={"format": "mlx"})
        except (OSError, RuntimeError) as e:
            raise MlxInferError(f"cannot write {folder / name}: {' '.join(str(e).split())}") from None
        weight_map.update(dict.fromkeys(tensors, name))
        on_shard(sum(t.nbytes for t in tensors.values()))
        del shard, tensors
    index = {
        "metadata": {"total_size": total_size, "total_parameters": total_params},
        "weight_map": dict(sorted(weight_map.items())),
    }
    write_json(folder / INDEX_FILE, index)
    return index


def output_config(
    config: dict[str, Any], quantization: dict[str, Any] | None, dtype: str
) -> dict[str, Any]:
    """The source config with mlx-lm's ``quantization`` key (and its ``quantization_config`` copy, which
    Hugging Face tooling reads) replaced by the output's, and the dtype of the floating weights."""
    out = {k: v for k, v in config.items() if k not in ("quantization", "quantization_config")}
    out["torch_dtype"] = dtype
    if quantization is not None:
        out["quantization"] = quantization
        out["quantization_config"] = dict(quantization)
    return dict(sorted(out.items()))


def write_tokenizer(folder: Path, source: Path, tokenizer: Any, max_length: int) -> list[str]:
    """Copy a Hugging Face folder's tokenizer files, or build them from a GGUF's tokenizer."""
    if source.is_dir():
        copied = []
        for name in TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copy2(source / name, folder / name)
                copied.append(name)
        return copied
    tokenizer.backend.save(str(folder / "tokenizer.json"))
    template = tokenizer.chat_template
    if isinstance(template, dict):  # named templates, saved as transformers saves them
        template = [{"name": k, "template": v} for k, v in template.items()]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **tokenizer.special_tokens,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    write_json(folder / "tokenizer_config.json", config)
    generation: dict[str, Any] = {"eos_token_id": sorted(tokenizer.eos_token_ids)}
    if tokenizer.bos_token_id is not None:
        generation["bos_token_id"] = tokenizer.bos_token_id
    write_json(folder / "generation_config.json", generation)
    return ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]


def write_json(path: Path, value: Any) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
