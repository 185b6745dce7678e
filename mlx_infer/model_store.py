"""The models on this machine and the downloads that add to them (``mlx-infer models``, ``pull``, ``rm``).

Three places hold models: the Hugging Face cache (repo ids, as ``pull`` and ``serve -m ORG/NAME`` leave
them), mlx-infer's own cache (``~/.cache/mlx-infer``, where ``make model`` puts SmolLM2) and folders the
user names (``--dir``, or ``MLX_INFER_MODELS_PATH``: GGUF files and model folders found under them).
Each model is described from its headers only (``config.json`` or the GGUF metadata), never loaded.
"""

from __future__ import annotations

import json
import os
import re
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


def _hf_cache_models(problems: list[str] | None = None) -> Iterator[LocalModel]:
    """The models of the Hugging Face cache; a line for each repo it cannot read goes to ``problems``."""
    from huggingface_hub import scan_cache_dir
    from huggingface_hub.errors import CacheNotFound

    try:
        cache = scan_cache_dir(_hf_hub_cache())
    except CacheNotFound:
        return
    if problems is not None:
        problems.extend(_cache_problems(cache.warnings))
    for repo in sorted(cache.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model":
            continue
        revision = _listed_revision(repo.revisions)
        if revision is None:  # only empty snapshot folders: no model
            continue
        snapshot = revision.snapshot_path
        ggufs = sorted(snapshot.rglob("*.gguf"))
        if (snapshot / "config.json").is_file() or not ggufs:
            arch, quant = describe(snapshot)
            yield LocalModel(repo.repo_id, str(snapshot), "hf-cache", repo.size_on_disk, arch, quant)
        else:
            # A GGUF repo holds one file per quantization: each is a model of its own, named by its path.
            for path in ggufs:
                arch, quant = describe(path)
                yield LocalModel(str(path), str(path), "hf-cache", path.stat().st_size, arch, quant)


def _listed_revision(revisions: Iterable[Any]) -> Any | None:
    """The snapshot ``models`` describes: the one refs/main names (what ``-m ORG/NAME`` loads), else the
    newest, ties broken by commit hash (the same every run); snapshots with no file are none."""
    held = [r for r in revisions if r.files]
    main = [r for r in held if "main" in r.refs]
    if main:
        return main[0]
    return max(held, key=lambda r: (r.last_modified, r.commit_hash), default=None)


def _cache_problems(warnings: Iterable[Exception]) -> list[str]:
    """One line per model repo of the Hugging Face cache that scan_cache_dir could not read (a corrupt or
    partial download): what is wrong and how to delete it."""
    lines = {}
    for warning in warnings:
        message = " ".join(str(warning).split())
        found = re.search(r"models--([^/\s'\")]+)", message)
        if not found:  # a dataset's or Space's, or a stray folder: not a model
            continue
        folder = found.group(1)
        repo_id = folder.replace("--", "/")
        if "Blob missing" in message:
            what = f"a snapshot file links to a missing blob ({message.rsplit(': ', 1)[-1]})"
        elif "Snapshots dir doesn't exist" in message:
            repo_path = _hf_hub_cache() / f"models--{folder}"
            refs = sorted(p for p in (repo_path / "refs").rglob("*") if p.is_file())
            if any((repo_path / "blobs").glob("*.incomplete")):
                what = "no snapshot, only an interrupted download (blobs/*.incomplete)"
            elif refs:
                named = ", ".join(
                    f"{p.relative_to(repo_path / 'refs')} -> {p.read_text().strip()}" for p in refs
                )
                what = f"a ref names a snapshot that is missing ({named})"
            else:
                what = "no snapshot"
        elif "missing commit hashes" in message:
            missing = re.findall(r"'([^']+)': \{([^}]*)\}", message)
            named = ", ".join(f"{refs.replace(chr(39), '')} -> {sha}" for sha, refs in missing)
            what = f"a ref names a snapshot that is missing ({named or message})"
        else:
            what = message
        lines.setdefault(
            repo_id, f"{repo_id}: unreadable cache entry, {what}; `mlx-infer rm {repo_id}` deletes it"
        )
    return [lines[k] for k in sorted(lines)]


def _hf_hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE).expanduser().resolve()


def list_models(
    extra_dirs: Iterable[str] = (), check_fit: bool = True, problems: list[str] | None = None
) -> list[LocalModel]:
    """Every model in the Hugging Face cache, mlx-infer's cache and the configured folders; ``problems``
    gets a line for each Hugging Face cache entry that could not be read."""
    found = list(_hf_cache_models(problems))
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
    """FIT_FRACTION of the machine's budget: ``$MLX_INFER_MEMORY_BUDGET`` where set, as ``plan`` and
    ``serve`` of one model take it, else the device's memory."""
    from mlx_infer.plan.planner import memory_budget as machine_budget

    return int(machine_budget()[0] * FIT_FRACTION)


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
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def remove(name: str) -> tuple[str, int]:
    """Delete ``name`` (a repo id of the Hugging Face cache, or a path in mlx-infer's cache or the Hugging
    Face cache as ``models`` lists it); returns (what was deleted, bytes freed). Models in the user's own
    folders are not deleted: those files are the user's."""
    try:
        hub_cache: Path | None = _hf_hub_cache()
    except (OSError, RuntimeError):
        hub_cache = None
    # A repo id: its folder, whatever state it is in (a corrupt or partial download scan_cache_dir cannot
    # read too): every revision, ref and blob.
    if hub_cache is not None and _REPO_ID.fullmatch(name):
        repo_path = hub_cache / f"models--{name.replace('/', '--')}"
        if repo_path.is_dir() and not repo_path.is_symlink():
            return f"{name} ({repo_path})", _remove_tree(repo_path)
    path = _canonical(Path(name).expanduser())
    present = path.exists() or path.is_symlink()
    if hub_cache is not None and present and path.is_relative_to(hub_cache):
        parts = path.relative_to(hub_cache).parts
        repo_path = hub_cache / parts[0]
        if parts[0].startswith("models--") and repo_path.is_dir() and not repo_path.is_symlink():
            repo_id = parts[0].removeprefix("models--").replace("--", "/")
            # A GGUF file of a snapshot (of any revision): a model of its own.
            if len(parts) > 3 and parts[1] == "snapshots" and path.suffix == ".gguf" and not path.is_dir():
                return _remove_snapshot_file(path, repo_path, repo_id)
            # The repo folder, a snapshot folder (the path `models` gives a model folder) or a file in one:
            # the snapshot's files are links to blobs that other revisions may share, and a snapshot gone
            # alone leaves refs naming it, so the whole repo goes, as `rm ORG/NAME` does.
            if len(parts) == 1 or parts[1] == "snapshots" and len(parts) > 2:
                return f"{repo_id}, the whole repo, every revision ({repo_path})", _remove_tree(repo_path)
    # Only what `models` lists from mlx-infer's cache: the rest of it (the planner's measurements, built
    # kernels, a user's notes) is not a model, and a path that merely lies under a cache is not one.
    root = Path(os.path.realpath(mlx_infer_cache()))
    if present and path.is_relative_to(root):
        listed = {_canonical(Path(m.path)) for m in list_models(check_fit=False) if m.where == "mlx-infer"}
        if path in listed:
            if path.is_symlink():
                # A file linked from elsewhere in the cache goes with its link. A link to anything outside
                # the cache (or to a folder) is removed alone: what it points at is not ours.
                target = path.resolve()
                gone = [target] if target.is_file() and target.is_relative_to(root) else []
                freed = _freed_by_removing(gone)
                for f in [*gone, path]:
                    f.unlink()
                return str(path), freed
            if path.is_dir():
                return str(path), _remove_tree(path)
            freed = _freed_by_removing([path])
            path.unlink()
            return str(path), freed
    raise ModelNotFound(
        f"{name}: not a model in the Hugging Face cache or in {mlx_infer_cache()} (`mlx-infer models` "
        "lists them by the name rm takes; files in your own folders are yours to delete)"
    )


def _canonical(path: Path) -> Path:
    """``path`` absolute, with the folders above it real and its last component as given (a link is
    removed, not what it points at)."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def _freed_by_removing(files: Iterable[Path]) -> int:
    """The bytes deleting ``files`` frees: regular files (not links) all of whose hard links are among
    them, each once."""
    inodes: dict[tuple[int, int], list[os.stat_result]] = {}
    for f in files:
        try:
            st = f.lstat()
        except OSError:
            continue
        if not os.path.islink(f) and f.is_file():
            inodes.setdefault((st.st_dev, st.st_ino), []).append(st)
    return sum(sts[0].st_size for sts in inodes.values() if len(sts) >= sts[0].st_nlink)


def _remove_tree(folder: Path) -> int:
    """Delete ``folder`` and what it holds (links, not what they point at); returns the bytes freed."""
    files = [Path(d) / f for d, _, names in os.walk(folder) for f in names]
    freed = _freed_by_removing(files)
    shutil.rmtree(folder)
    return freed


def _link_target(link: Path) -> Path:
    """Where a link points, one hop (as huggingface-hub reads a snapshot's link to its blob)."""
    return _canonical(link.parent / os.readlink(link))


def _remove_snapshot_file(path: Path, repo_path: Path, repo_id: str) -> tuple[str, int]:
    """Delete one GGUF file of a snapshot: its link, and its blob unless another file of the repo (another
    revision's) links to it. A repo left with no model (no GGUF, no config.json) goes whole."""
    snapshots = repo_path / "snapshots"
    gone = [path]
    if path.is_symlink():
        blob = _link_target(path)
        others = (
            Path(d) / f
            for d, _, names in os.walk(snapshots)
            for f in names
            if Path(d) / f != path and os.path.islink(Path(d) / f)
        )
        shared = any(_link_target(other) == blob for other in others)
        if not shared and blob.parent == repo_path / "blobs" and (blob.exists() or blob.is_symlink()):
            gone.append(blob)
    freed = _freed_by_removing(gone)
    for f in gone:
        f.unlink()
    # Folders the file was alone in go too; a snapshot left empty with the refs naming it (they would
    # name a missing snapshot, which makes the repo unreadable to huggingface-hub).
    snapshot = snapshots / path.relative_to(snapshots).parts[0]
    folder = path.parent
    while folder != snapshot and not any(folder.iterdir()):
        folder.rmdir()
        folder = folder.parent
    if not any(f for _, _, names in os.walk(snapshot) for f in names):
        freed += _remove_tree(snapshot)
        refs = repo_path / "refs"
        for ref in [Path(d) / f for d, _, names in os.walk(refs) for f in names]:
            if ref.read_text().strip() == snapshot.name:
                freed += _freed_by_removing([ref])
                ref.unlink()
    left = (f for _, _, names in os.walk(snapshots) for f in names)
    if not any(f == "config.json" or f.endswith(".gguf") for f in left):
        freed += _remove_tree(repo_path)
        return f"{path} and the rest of {repo_id}, which holds no model now ({repo_path})", freed
    return str(path), freed


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
