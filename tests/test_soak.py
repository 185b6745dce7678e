"""The short soak (``benchmarks/soak.py``) against ``mlx-infer serve`` on SmolLM2: 16 valid requests at
once with 7 hostile ones, for 3 rounds; every valid answer equals its solo run, no 5xx, memory flat, and
the KV blocks and request tables back to baseline once idle."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from server_helpers import LiveServer

from mlx_infer import cpu_kernels

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import soak  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

ROUNDS, CONCURRENCY, HOSTILE = 3, 16, 7


def test_short_soak(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch):
    # The path users run (conftest pins float32 for the exact oracles): the default activations, whose
    # answers must not depend on what else is in the batch either.
    monkeypatch.setenv("MLX_INFER_CPU_ACTIVATIONS", cpu_kernels.DEFAULT_ACTIVATIONS)
    server = LiveServer(smollm2_path, "--kv-memory", "0.3", "--max-num-seqs", str(CONCURRENCY))
    try:
        argv = ["--rounds", str(ROUNDS), "--concurrency", str(CONCURRENCY), "--hostile", str(HOSTILE)]
        args = soak.parse_args([*argv, "--max-tokens", "16", "--prompts", "8", "--slow-read-seconds", "2"])
        report = soak.soak(soak.Target("mlx-infer", server.base_url, server.name, server.process.pid), args)
        print(soak.table([report]))
        assert report.sent == {
            "chat": ROUNDS * CONCURRENCY // 2,
            "chat_stream": ROUNDS * CONCURRENCY // 2,
            **{kind: ROUNDS for kind in soak.HOSTILE_KINDS},
        }
        assert report.failures() == []
        # Each hostile kind got the answer it should: refused with a 4xx, or served to a client that left.
        for kind in ("bad_field", "deep_nesting", "non_utf8"):
            assert set(report.statuses[kind]) == {400}, (kind, report.statuses[kind])
        assert set(report.statuses["huge_body"]) <= {413, "reset"}
        assert report.end == report.start == {"blocks": 0, "tables": 0}
    finally:
        server.stop()
