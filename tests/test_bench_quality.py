"""benchmarks/bench_quality.py: llama-perplexity's statistics parsed, the lockstep measurement, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_tiny_llama

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_quality.py"
sys.path.insert(0, str(BENCH.parent))

import bench_quality  # noqa: E402
import peers  # noqa: E402

# A real `llama-perplexity --kl-divergence` run (SmolLM2 Q4_1 against its F32 GGUF, -c 256 --chunks 4), its
# per-chunk table and the Δp percentiles cut.
KLD_OUTPUT = """\
0.00.335.907 I kl_divergence: computing over 4 chunks, n_ctx=256, batch_size=2048, n_seq=8

====== Perplexity statistics ======
Mean PPL(Q)                   :  21.133798 ±   2.730273
Mean PPL(base)                :  20.982065 ±   2.708205
Cor(ln(PPL(Q)), ln(PPL(base))):  99.95%
Mean ln(PPL(Q)/PPL(base))     :   0.007206 ±   0.003971
Mean PPL(Q)/PPL(base)         :   1.007232 ±   0.004000
Mean PPL(Q)-PPL(base)         :   0.151733 ±   0.086450

====== KL divergence statistics ======
Mean    KLD:   0.004245 ±   0.000405
Maximum KLD:   0.127810
99.9%   KLD:   0.107160
99.0%   KLD:   0.046719
95.0%   KLD:   0.012581
90.0%   KLD:   0.007611
Median  KLD:   0.002352
10.0%   KLD:   0.000708
 5.0%   KLD:   0.000407
 1.0%   KLD:   0.000060
 0.1%   KLD:   0.000014
Minimum KLD:   0.000002

====== Token probability statistics ======
Same top p: 96.457 ± 0.821 %

"""


def test_parse_kld_reads_llama_perplexity_statistics() -> None:
    q = peers.parse_kld(KLD_OUTPUT, ctx=256)
    assert (q.chunks, q.tokens, q.ctx) == (4, 4 * 127, 256)
    assert (q.kl_mean, q.kl_p99, q.kl_max) == (0.004245, 0.046719, 0.127810)
    assert q.same_top == pytest.approx(0.96457)
    assert (q.ppl_base, q.ppl) == (20.982065, 21.133798)


def test_parse_kld_without_statistics_says_why() -> None:
    # llama-perplexity prints no statistics for fewer than 100 scored tokens.
    cut = KLD_OUTPUT.split("====== Perplexity")[0]
    with pytest.raises(RuntimeError, match=r"printed no 'Mean KLD' \(too few tokens scored\?\)"):
        peers.parse_kld(cut, ctx=256)


def test_an_option_that_changes_nothing_measures_exactly_zero() -> None:
    """The lockstep paths each keep their own cache: the exact path measured against itself is 0,
    as speculative decoding must measure."""
    model = make_tiny_llama(0)
    windows = [[1, 5, 9, 3, 7, 7, 2, 40, 11, 5, 6, 8, 9, 60, 1, 2, 3, 4, 5], [1, 10, 20, 30]]
    [q] = bench_quality.measure(model, windows, [bench_quality.Option("again")]).values()
    assert (q.tokens, q.windows) == (18 + 3, 2)
    assert q.kl_mean == q.kl_max == 0.0 and q.top1_agreement == 1.0 and q.ppl_source == q.ppl_output


def test_kv_cache_options_measure_their_pools_loss() -> None:
    """Each KV option's path decodes over a pool of its dtype: a loss above 0, larger for coarser rows."""
    model = make_tiny_llama(0)
    windows = [[1, 5, 9, 3, 7, 7, 2, 40, 11, 5, 6, 8, 9, 60, 1, 2, 3, 4, 5]]
    kv = [bench_quality.Option(d, kv_cache_dtype=d) for d in ("float16", "bfloat16", "int8")]
    q = bench_quality.measure(model, windows, kv)
    assert 0 < q["float16"].kl_mean < q["bfloat16"].kl_mean and 0 < q["int8"].kl_mean
    assert all(r.kl_mean < 0.05 for r in q.values())


class _WordTokenizer:
    """Token i for the word "w{i}"; BOS (id 1) in front when asked for special tokens."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + [int(w[1:]) for w in text.split()]


def test_chunks_are_cut_as_llama_perplexity_cuts_them(tmp_path: Path) -> None:
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"w{i}" for i in range(10, 40)))
    # -c 8 scores 3 positions a chunk: 7 wanted -> 3 chunks; the stream is BOS + 30 tokens.
    chunks = bench_quality.llama_chunks(_WordTokenizer(), text, 8, 7)
    assert chunks == [[1, *range(10, 17)], [1, *range(18, 25)], [1, *range(26, 33)]]
    # Only as many chunks as the text holds; none at all is one clear error.
    assert len(bench_quality.llama_chunks(_WordTokenizer(), text, 8, 1000)) == 31 // 8
    with pytest.raises(bench_quality.InvalidRequest, match="fewer than --chunk 64 tokens"):
        bench_quality.llama_chunks(_WordTokenizer(), text, 64, 10)


def test_only_the_positions_from_skip_on_are_scored() -> None:
    windows = [[1, *range(10, 17)], [1, *range(18, 25)]]
    [q] = bench_quality.measure(make_tiny_llama(0), windows, [bench_quality.Option("again")], skip=4).values()
    assert q.tokens == 2 * (8 - 1 - 4)


def test_unreadable_text_is_one_clear_error(tiny_llama_folder: Path, tmp_path: Path, capsys) -> None:
    assert bench_quality.main(["-m", str(tiny_llama_folder), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "cannot read evaluation text" in capsys.readouterr().out


@pytest.mark.slow
def test_bench_quality_smoke(smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2 end to end, 24 tokens: the default int16 activations and the int8 ones differ from the
    exact path (the settings do switch per path), int8 more, and a missing llama.cpp is a skipped line,
    not a failure."""
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH), "-m", str(smollm2_path), "--tokens", "24", "--compare", "llama.cpp",
         "--llama-dir", str(tmp_path), "--json", str(out)],
        capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "quality against the exact path" in proc.stdout
    data = json.loads(out.read_text())
    assert data["machine"]["cpus"] >= 1 and data["skipped"][0].startswith("llama.cpp: ")
    [row] = [r for r in data["results"] if r["option"] == "int16 activations (default --cpu-activations)"]
    assert row["tokens"] == 23 and row["kernel"] == "int16"
    assert 0 < row["kl_mean"] < 1e-3 and row["top1_agreement"] == 1
    [int8] = [r for r in data["results"] if r["option"] == "int8 activations (--cpu-activations int8)"]
    assert int8["kernel"].startswith("int8") and row["kl_mean"] < int8["kl_mean"] < 1
    [kv] = [r for r in data["results"] if r["option"] == "int8 KV (--kv-cache-dtype int8)"]
    assert kv["kernel"] == "float32" and 0 < kv["kl_mean"] < 1 and 0.5 < kv["top1_agreement"] <= 1
