"""The models on this machine and the downloads that add to them (``mlx-infer models``, ``pull``, ``rm``).

Three places hold models: the Hugging Face cache (repo ids, as ``pull`` and ``serve -m ORG/NAME`` leave
them), mlx-infer's own cache (``~/.cache/mlx-infer``, where ``make model`` puts SmolLM2) and folders the
user names (``--dir``, or ``MLX_INFER_MODELS_PATH``: GGUF files and model folders found under them).
Each model is described from its headers only (``config.json`` or the GGUF metadata), never loaded.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from mlx_infer.errors import InvalidRequest, MlxInferError, ModelNotFound
from mlx_infer.loading import hub

MODELS_PATH_ENV = "MLX_INFER_MODELS_PATH"
# mlx-infer's cache also holds built kernels and downloads in progress: not models.
_CACHE_SKIP = {"cpu_kernels", "blas", "download"}
# A model "fits" when its weights, plus this share again for the KV cache, activations and the runtime,
# take at most FIT_FRACTION of the device's memory (the recommended working set on Metal, RAM on the CPU).
FIT_OVERHEAD = 0.2
FIT_FRACTION = 0.75


@dataclass
class LocalModel:
    name: str  # what ``serve -m`` and ``rm`` take: a repo id (Hugging Face cache) or a path
    path: str  # the model folder or .gguf file
    where: str  # "hf-cache", "mlx-infer" or "folder"
    size: int  # bytes on disk
    architecture: str  # config.json's model_type or GGUF general.architecture; "?" when unknown
    quantization: str  # "Q4_1", "4-bit, group 64", "bfloat16", ...; "?" when unknown
    fits: bool | None = None  # None: not checked

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- describing one model ----------------------------------------------------------------------
def describe_gguf(path: Path) -> tuple[str, str]:
    """(architecture, quantization) of a GGUF file, from its header."""
    from gguf.constants import LlamaFileType

    from mlx_infer.loading.gguf_file import read_header

    header = read_header(path)
    meta = header.metadata
    arch = str(meta.get("general.architecture", "?"))
    file_type = meta.get("general.file_type")
    try:
        return arch, LlamaFileType(file_type).name.removeprefix("MOSTLY_")
    except ValueError:
        # No (or an unknown) declared file type: name it after the commonest matrix type.
        kinds = Counter(t.qtype.name for t in header.tensors.values() if len(t.shape) == 2)
        return arch, kinds.most_common(1)[0][0] if kinds else "?"


def describe_config(config: dict[str, Any]) -> tuple[str, str]:
    """(architecture, quantization) of a Hugging Face / MLX folder, from its config.json."""
    if not isinstance(config, dict):
        raise ValueError("config.json is not a JSON object")
    arch = str(config.get("model_type") or config.get("text_config", {}).get("model_type") or "?")
    quant = config.get("quantization") or config.get("quantization_config")
    if isinstance(quant, dict):
        if "bits" in quant and "quant_method" not in quant:  # MLX affine quantization
            return arch, f"{quant['bits']}-bit, group {quant.get('group_size', 64)}"
        method = quant.get("quant_method", "quantized")
        bits = quant.get("bits")
        return arch, f"{method} {bits}-bit" if bits else str(method)
    return arch, str(config.get("torch_dtype") or config.get("dtype") or "?")


_SAFETENSORS_DTYPES = {"F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64"}


def safetensors_dtype(folder: Path) -> str:
    """The commonest floating dtype of the first safetensors file's tensors, from its JSON header."""
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        return "?"
    with open(files[0], "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(min(length, 100_000_000)))
    kinds = Counter(v["dtype"] for k, v in header.items() if k != "__metadata__" and isinstance(v, dict))
    floats = [(n, d) for d, n in kinds.items() if d in _SAFETENSORS_DTYPES]
    return _SAFETENSORS_DTYPES[max(floats)[1]] if floats else "?"


def describe(path: Path) -> tuple[str, str]:
    """(architecture, quantization) of a model folder or GGUF file; ("?", "?") when unreadable."""
    from mlx_infer.errors import MlxInferError

    try:
        if path.is_file():
            return describe_gguf(path)
        config = path / "config.json"
        if config.is_file():
            arch, quant = describe_config(json.loads(config.read_text()))
            # An MLX-written folder may name no dtype: its weights' header does.
            return arch, safetensors_dtype(path) if quant == "?" else quant
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            return describe_gguf(ggufs[0])
    except (OSError, ValueError, KeyError, TypeError, struct.error, MlxInferError):
        pass
    return "?", "?"


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    # Files only once each: a Hugging Face snapshot links every file to a blob.
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# ---- where models are ------------------------------------------------------------------------
def mlx_infer_cache() -> Path:
    return Path(os.environ.get("MLX_INFER_CACHE", "~/.cache/mlx-infer")).expanduser()


def configured_dirs(extra: Iterable[str] = ()) -> list[Path]:
    """Folders named by ``--dir`` and by ``MLX_INFER_MODELS_PATH`` (``os.pathsep``-separated)."""
    names = [*extra, *os.environ.get(MODELS_PATH_ENV, "").split(os.pathsep)]
    return [Path(n).expanduser() for n in names if n]


def _models_under(root: Path, skip: set[str] = frozenset()) -> Iterator[Path]:
    """GGUF files and folders with a config.json under ``root``, not descending into a model folder."""
    if not root.is_dir():
        return
    # Linked folders are followed, as linked GGUF files are; each real folder once (a link cycle ends).
    seen: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=True):
        here = Path(dirpath)
        real = os.path.realpath(dirpath)
        if real in seen:
            dirnames.clear()
            continue
        seen.add(real)
        if "config.json" in filenames:
            dirnames.clear()
            yield here
            continue
        dirnames[:] = sorted(d for d in dirnames if d not in skip and not d.startswith("."))
        for name in sorted(filenames):
            if name.endswith(".gguf"):
                yield here / name


def _hf_cache_models() -> Iterator[LocalModel]:
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        return
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        snapshot = max(repo.revisions, key=lambda r: r.last_modified).snapshot_path
        ggufs = sorted(snapshot.rglob("*.gguf"))
        if (snapshot / "config.json").is_file() or not ggufs:
            arch, quant = describe(snapshot)
            yield LocalModel(repo.repo_id, str(snapshot), "hf-cache", repo.size_on_disk, arch, quant)
        else:
            # A GGUF repo holds one file per quantization: each is a model of its own, named by its path.
            for path in ggufs:
                arch, quant = describe(path)
                yield LocalModel(str(path), str(path), "hf-cache", path.stat().st_size, arch, quant)


def list_models(extra_dirs: Iterable[str] = (), check_fit: bool = True) -> list[LocalModel]:
    """Every model in the Hugging Face cache, mlx-infer's cache and the configured folders."""
    found = list(_hf_cache_models())
    sources = [(mlx_infer_cache(), "mlx-infer", _CACHE_SKIP)] + [
        (d, "folder", set()) for d in configured_dirs(extra_dirs)
    ]
    seen = {m.path for m in found}
    for root, where, skip in sources:
        for path in _models_under(root, skip):
            if str(path) in seen:
                continue
            seen.add(str(path))
            arch, quant = describe(path)
            found.append(LocalModel(str(path), str(path), where, _size(path), arch, quant))
    if check_fit:
        budget = memory_budget()
        for m in found:
            m.fits = fits(m.size, budget)
    return found


def local_model(path: Path, where: str = "folder") -> LocalModel:
    """One model folder or GGUF file, described from its headers (``serve``'s several models)."""
    arch, quant = describe(path)
    return LocalModel(str(path), str(path), where, _size(path), arch, quant)


def models_in(folder: Path) -> list[LocalModel]:
    """The GGUF files and model folders under ``folder`` alone (``serve --models-dir``), described."""
    return [local_model(path) for path in _models_under(folder)]


def memory_budget() -> int:
    from mlx_infer.kv.memory import device_memory_bytes

    return int(device_memory_bytes() * FIT_FRACTION)


def fits(weight_bytes: int, budget: int) -> bool:
    return weight_bytes * (1 + FIT_OVERHEAD) <= budget


# ---- pull ----------------------------------------------------------------------------------------
def choose_patterns(files: list[str], include: list[str] | None) -> list[str]:
    """What ``pull`` fetches: ``include`` if given; else what a model folder needs, or the one GGUF file
    of a GGUF repo (several: the user picks one, as downloading every quantization is rarely wanted)."""
    if include:
        return include
    ggufs = sorted(f for f in files if f.endswith(".gguf"))
    if ggufs and not any(f.endswith(".safetensors") for f in files):
        if len(ggufs) > 1:
            listed = ", ".join(ggufs[:8]) + (f", ... ({len(ggufs) - 8} more)" if len(ggufs) > 8 else "")
            raise InvalidRequest(
                f"this repo holds {len(ggufs)} GGUF files; pick one with --include (e.g. --include "
                f"'*{ggufs[0].rsplit('.', 2)[-2]}.gguf'): {listed}"
            )
        return ggufs
    return list(hub.ALLOW_PATTERNS)


def pull(
    repo_id: str, revision: str | None = None, include: list[str] | None = None, tqdm_class=None
) -> Path:
    """Download ``repo_id`` into the Hugging Face cache, file by file; returns the snapshot folder.

    ``tqdm_class``: a progress bar per file (huggingface-hub's ``tqdm_class``). Files already complete are
    not fetched again, so running ``pull`` again after an interruption fetches only what is missing; a
    connection dropped mid-file is resumed where it stopped (an HTTP Range request) by huggingface-hub.
    """
    from huggingface_hub import HfApi, constants, hf_hub_download
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError
    from huggingface_hub.utils import filter_repo_objects

    if not hub.looks_like_repo_id(repo_id):
        raise InvalidRequest(f"{repo_id!r} is not a Hugging Face repo id (ORG/NAME)")
    if constants.HF_HUB_OFFLINE:
        raise InvalidRequest("pull needs the network, and HF_HUB_OFFLINE is set")
    try:
        info = HfApi().model_info(repo_id, revision=revision)
        files = sorted(s.rfilename for s in info.siblings or [])
        wanted = list(filter_repo_objects(files, allow_patterns=choose_patterns(files, include)))
        if not wanted:
            raise InvalidRequest(f"{repo_id}: no file matches {include or hub.ALLOW_PATTERNS}")
        for name in wanted:
            # The commit, not the branch: every file comes from the same snapshot even if one is pushed
            # meanwhile, and a file already in the snapshot is returned without a request.
            last = hf_hub_download(repo_id, name, revision=info.sha, tqdm_class=tqdm_class)
    except RepositoryNotFoundError:
        raise ModelNotFound(f"{repo_id}: no such model on the Hugging Face Hub (or it is private)") from None
    except RevisionNotFoundError:
        raise ModelNotFound(f"{repo_id}: no revision {revision!r} on the Hugging Face Hub") from None
    except MlxInferError:
        raise
    # HTTP errors, a full disk, and the Hub unreachable: that one is the error of the HTTP client
    # huggingface_hub brings (its own httpx fork), which it does not wrap.
    except Exception as e:  # noqa: BLE001
        reason = " ".join(str(e).split()) or type(e).__name__
        raise ModelNotFound(f"{repo_id}: download failed ({reason}); run pull again to resume") from None
    if (revision or "main") != info.sha:
        _remember_ref(repo_id, revision or "main", info.sha)
    return Path(last).parents[len(Path(wanted[-1]).parts) - 1]


def _remember_ref(repo_id: str, revision: str, sha: str) -> None:
    """Record ``revision`` -> ``sha`` in the cache, as snapshot_download does for a branch name, so
    ``serve -m ORG/NAME`` finds the snapshot offline (downloads by commit record no ref)."""
    from huggingface_hub import constants

    ref = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)  # refs/pr/1 has a folder of its own
    ref.write_text(sha)


# ---- rm --------------------------------------------------------------------------------------------
def remove(name: str) -> tuple[str, int]:
    """Delete ``name`` (a repo id of the Hugging Face cache, or a path in mlx-infer's cache or the Hugging
    Face cache as ``models`` lists it); returns (what was deleted, bytes freed). Models in the user's own
    folders are not deleted: those files are the user's."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir()
    except CacheNotFound:
        cache = None
    if cache is not None:
        for repo in cache.repos:
            if repo.repo_type == "model" and repo.repo_id == name:
                shutil.rmtree(repo.repo_path)  # every revision, ref and blob of the repo
                return f"{name} ({repo.repo_path})", repo.size_on_disk
    # Not resolved: a file of a Hugging Face snapshot is a link to its blob, and both must go.
    path = Path(os.path.abspath(Path(name).expanduser()))
    roots = [Path(os.path.abspath(mlx_infer_cache()))]
    if cache is not None:
        from huggingface_hub import constants

        roots.append(Path(os.path.abspath(constants.HF_HUB_CACHE)))
    # Only what `models` lists from the caches: the rest of a cache (the planner's measurements, built
    # kernels, a user's notes) is not a model, and a path that merely lies under a cache is not one.
    listed = {os.path.abspath(m.path) for m in list_models(check_fit=False) if m.where != "folder"}
    for root in roots:
        if path.exists() and path.is_relative_to(root) and str(path) in listed:
            size = _size(path)
            if path.is_symlink():
                # A snapshot file links to its blob in the same cache: both go. A link to anything
                # outside the cache (or to a folder) is removed alone: what it points at is not ours.
                target = path.resolve()
                if target.is_file() and target.is_relative_to(Path(os.path.realpath(root))):
                    target.unlink()
                path.unlink()
            elif path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
            return str(path), size
    raise ModelNotFound(
        f"{name}: not a model in the Hugging Face cache or in {mlx_infer_cache()} (`mlx-infer models` "
        "lists them by the name rm takes; files in your own folders are yours to delete)"
    )


def served_name(model: str, explicit: str | None = None) -> str:
    """The name a model goes by in API bodies (``model``): a GGUF's file stem, a folder's name, a repo id
    as given, unless ``--served-model-name`` names it."""
    if explicit:
        return explicit
    path = Path(model)
    return path.stem if path.suffix == ".gguf" else (path.name if path.exists() else model)


def served_details(source: str) -> dict[str, str]:
    """What ``/v1/models`` says of the served checkpoint, beside its context length."""
    arch, quant = describe(Path(source))
    return {"architecture": arch, "quantization": quant}
