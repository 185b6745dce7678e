"""A live ``mlx-infer serve`` in a subprocess, and small readers of its endpoints, for the server tests."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

# SmolLM2-135M's KV pool in the CPU backend's default float16 (--kv-cache-dtype auto):
# 30 layers x (K and V) x 3 KV heads x 64 dims x 2 bytes.
SMOLLM2_KV_BYTES_PER_TOKEN = 30 * 2 * 3 * 64 * 2


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_gib_for_blocks(num_blocks: int, block_size: int = 16) -> float:
    """The ``--kv-memory`` that yields exactly ``num_blocks`` blocks (half a block of slack for rounding)."""
    return (num_blocks + 0.5) * block_size * SMOLLM2_KV_BYTES_PER_TOKEN / 2**30


class LiveServer:
    """``mlx-infer serve -m MODEL ARGS`` on a free loopback port; ``stop()`` terminates it.

    ``model``: a list gives ``-m`` once each (several models); None gives none (``--models-dir`` in
    ``args``). ``name``: the ``--served-model-name``, None for none.

    ``preamble``: Python run in the server process before the CLI (to slow or break a part for a test).
    ``wait_healthy``: return only once /health answers 200.
    """

    def __init__(
        self,
        model: Path | list[Path] | None,
        *args: str,
        name: str | None = "smollm2",
        startup_timeout: float = 180.0,
        launch_hosts: str | None = None,
        preamble: str | None = None,
        wait_healthy: bool = True,
    ):
        self.name = name
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._log = tempfile.NamedTemporaryFile("w+", prefix="mlx-infer-serve-", suffix=".log", delete=False)
        entry = ["-m", "mlx_infer.cli"]
        models = model if isinstance(model, list) else [] if model is None else [model]
        if preamble is not None:
            main = "import sys\nfrom mlx_infer.cli import main\nsys.exit(main(sys.argv[1:]))"
            entry = ["-c", f"{preamble}\n{main}"]
        command = [
            sys.executable,
            *entry,
            # Under `launch`, one rank per host; rank 0 serves on the port.
            *(["launch", "--hosts", launch_hosts, "--"] if launch_hosts else []),
            "serve",
            *[arg for m in models for arg in ("-m", str(m))],
            "--port",
            str(self.port),
            *(["--served-model-name", name] if name else []),
            *args,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1"}
        self.process = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        if wait_healthy:
            self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        self.wait_for_health(200, timeout)

    def wait_for_health(self, status: int, timeout: float) -> httpx.Response:
        """Poll /health until it answers ``status``; returns that answer."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with {self.process.returncode}:\n{self.log()}")
            try:
                response = httpx.get(f"{self.base_url}/health", timeout=1.0)
                if response.status_code == status:
                    return response
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        log = self.log()
        self.stop()
        raise RuntimeError(f"/health did not answer {status} in {timeout:.0f} s:\n{log}")

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(f"{self.base_url}/metrics", timeout=10).text)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        Path(self._log.name).unlink(missing_ok=True)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text format -> {sample name with labels: value} (comments skipped)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            values[name] = float(value)
    return values


def wait_for_idle(server: LiveServer, timeout: float = 10.0) -> dict[str, float]:
    """Poll /metrics until no request runs or waits and no KV block is referenced; returns the last read."""
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        idle = (
            m["mlx_infer_kv_blocks_used"] == 0
            and m["mlx_infer_requests_running"] == 0
            and m["mlx_infer_requests_waiting"] == 0
        )
        if idle or time.monotonic() > deadline:
            return m
        time.sleep(0.1)
