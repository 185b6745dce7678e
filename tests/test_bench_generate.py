"""benchmarks/bench_generate.py end to end on the real model, tiny sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_generate.py"
sys.path.insert(0, str(BENCH.parent))

import hardware  # noqa: E402


def test_decode_bound_counts_weights_once_and_kv_per_sequence() -> None:
    # 1 GB/s, 100 MB of weights, 1 kB of KV per token at context 1000 (1 MB per sequence).
    assert hardware.decode_bound(1e9, 100_000_000, 1000, 1, 1000) == pytest.approx(1e9 / 101e6)
    assert hardware.decode_bound(1e9, 100_000_000, 1000, 4, 1000) == pytest.approx(4e9 / 104e6)


def test_each_repetition_is_set_against_the_bandwidth_measured_before_it() -> None:
    import bench_generate
    from measure import Result

    # 100 MB of weights, no KV: 10 and 20 tok/s against bounds of 10 (1 GB/s) and 40 (4 GB/s).
    r = Result("mlx-infer", "q4", 1, decode=[10.0, 20.0], weight_bytes=100_000_000, bandwidth=[1e9, 4e9])
    assert bench_generate._bound(r, 2e9) == pytest.approx(25.0)
    assert bench_generate._share(r, 2e9) == pytest.approx((1.0 + 0.5) / 2)
    # no bandwidth measured per repetition: the one given (2 GB/s, a bound of 20)
    r.bandwidth = []
    assert bench_generate._bound(r, 2e9) == pytest.approx(20.0)
    assert bench_generate._share(r, 2e9) == pytest.approx((0.5 + 1.0) / 2)


@pytest.mark.slow
def test_bench_generate_smoke(smollm2_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "-m", str(smollm2_path), "-p", "16", "-n", "4", "-r", "2", "-b", "1,2",
         "--kv-cache-dtype", "float16,int8", "--cpu-activations", "int16,int8", "--profile",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "decode bound" in proc.stdout and "MLX ops per decode step" in proc.stdout
    data = json.loads(out.read_text())
    assert data["machine"]["read_bandwidth_bytes_per_s"] > 1e8
    ours = [r for r in data["results"] if r["engine"] == "mlx-infer"]
    # each activation kind named in the weights column, its rows in the same order as the other's
    kinds = [r["weights"].split(", ")[-1] for r in ours]
    assert kinds[:4] == ["int16 x"] * 4 and all(k.startswith("int8") and k.endswith(" x") for k in kinds[4:])
    rows = {(r["batch"], r["kv"]): r for r in ours[:4]}
    assert sorted(rows) == [(1, "float16"), (1, "int8"), (2, "float16"), (2, "int8")]
    # int8 rows: 64 values and a float32 scale per KV head, against 128 bytes in float16
    assert rows[1, "int8"]["kv_bytes_per_token"] / rows[1, "float16"]["kv_bytes_per_token"] == 68 / 128
    for r in rows.values():
        assert len(r["prefill"]) == 2 and len(r["decode"]) == 2
        assert all(x > 0 for x in r["prefill"] + r["decode"])
        # SmolLM2's weights as the native CPU kernels read them (4-bit layers with the GGUF's float16
        # scales and biases, the tied head 8-bit): ~98 MB per step, where float32 would be ~540 MB.
        assert 90e6 < r["weight_bytes"] < 105e6
        assert 0 < r["decode_bound"] < float("inf")
        # the bandwidth measured before each repetition, and each repetition against its own bound
        assert len(r["bandwidth"]) == 2 and all(bw > 1e8 for bw in r["bandwidth"])
        bounds = [hardware.decode_bound(bw, r["weight_bytes"], r["kv_bytes_per_token"], r["batch"],
                                        r["decode_context"]) for bw in r["bandwidth"]]
        assert r["decode_bound"] == pytest.approx(sum(bounds) / 2)
        assert r["of_bound"] == pytest.approx(sum(d / b for d, b in zip(r["decode"], bounds)) / 2)
    profile = {p["batch"]: p for p in data["profile"]}
    # The 30 layers are one native op (each: norm, q/k/v, RoPE, K/V writes, attention, o_proj, MLP); the
    # rest is the embedding (one op), RoPE tables, final norm, head and sampling: 15 ops measured.
    by_op = profile[1]["by_op"]
    assert by_op["NativeDecoderStack"] == 1 and by_op["NativeEmbedRows"] == 1
    assert "NativeKVWrite" not in by_op
    assert 10 < profile[1]["ops_per_step"] < 30
    assert profile[2]["ops_per_token"] == profile[2]["ops_per_step"] / 2


@pytest.mark.slow
def test_ab_builds_compares_builds_in_one_process(smollm2_path: Path, tmp_path: Path) -> None:
    """benchmarks/ab_builds.py on the package's own build given twice: a ratio for each batch size."""
    from mlx_infer import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("the native CPU kernels are not built here")
    build = cpu_kernels._native.__file__
    out = tmp_path / "ab.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH.parent / "ab_builds.py"), "-m", str(smollm2_path),
         "--builds", build, build, "-b", "1,2", "-p", "16", "--steps", "16", "--switch", "4",
         "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    assert [r["batch"] for r in results] == [1, 2]
    for r in results:
        assert r["ratio"][0] == 1.0 and 0.2 < r["ratio"][1] < 5 and all(m > 0 for m in r["median_step_s"])
