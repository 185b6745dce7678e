"""The native CPU kernels (mlx_infer/cpu_kernels) against float64 NumPy, and how they are chosen."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_infer import cli, cli_options, cpu_kernels
from mlx_infer.cpu_kernels import build
from mlx_infer.distributed import launch
from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.kv import pool_rows
from mlx_infer.loading import load
from mlx_infer.sampling import SamplingParams


@pytest.fixture(scope="module")
def native():
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
    return cpu_kernels._native


def _np_dequantize(w: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int) -> np.ndarray:
    """MLX's affine format read with NumPy: element i of a word sits at bits [bits*i, bits*(i+1))."""
    words = np.array(w).astype(np.uint64)
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint64) * bits
    q = ((words[..., None] >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], -1).astype(np.float64)
    s = np.repeat(np.array(scales, dtype=np.float64), group, axis=1)
    b = np.repeat(np.array(biases, dtype=np.float64), group, axis=1)
    return q * s + b


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 3, 6, 8, 40])
def test_quantized_matmul_equals_numpy(native, bits: int, group: int, rows: int):
    """Up to 7 rows take the fused matvec (4-row tiles and their remainder), 8 and more the tiles
    dequantized into the BLAS; 37 and 200 output features exercise the tails of the 4/2-feature
    tiles and of the 64-feature BLAS tiles."""
    rng = np.random.default_rng(bits * 1000 + group + rows)
    k = 256
    for features in (37, 200):
        weight = mx.array(rng.standard_normal((features, k)).astype(np.float32))
        w, scales, biases = mx.quantize(weight, group, bits)
        x = mx.array(rng.standard_normal((k, rows)).astype(np.float32)).T  # a transposed (strided) view
        out = cpu_kernels.quantized_matmul(x, w, scales, biases, group, bits)
        want = np.array(x, dtype=np.float64) @ _np_dequantize(w, scales, biases, group, bits).T
        assert out.dtype == mx.float32 and out.shape == (rows, features)
        np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-4)


def _switched_activations(kind: str):
    """``kind`` for one test; the suite otherwise runs float32 activations (see conftest.py)."""
    cpu_kernels.set_activations(kind)
    yield cpu_kernels.activations()
    cpu_kernels.set_activations("float32")


@pytest.fixture(params=["int8", "int8-256", "int8-avx2"])
def int8_activations(native, request):
    """Each int8 build: the default (512-bit vectors where this CPU has AVX-512 VNNI), the 256-bit one
    (VNNI where this CPU has it) and plain AVX2."""
    yield from _switched_activations(request.param)


@pytest.fixture
def int16_activations(native):
    yield from _switched_activations("int16")


@pytest.fixture(params=["int8", "int8-256", "int8-avx2", "int16"])
def integer_activations(native, request):
    """Each kind that quantizes x (every product's rows must be independent of each other)."""
    yield from _switched_activations(request.param)


def _np_int8_product(x: np.ndarray, w: mx.array, scales: mx.array, biases: mx.array, group: int, bits: int,
                     wide: bool = False):
    """The int8 scheme in NumPy: x rounded per block of 32 to x^ = dx * qx (dx = max|x| / L, qx
    integers in [-L, L]: L = 127 (int8) for 4-bit weights, 32639 (int16 split in two signed bytes) for
    8-bit ones and, when ``wide`` (the int16 activations), for 4-bit ones too), then exactly w . x^ in
    float64: the weight and the bias terms both meet the quantized x, as llama.cpp's Q4_1 x Q8_1
    products do."""
    rows, k = x.shape
    levels = np.float32(32639 if bits == 8 or wide else 127)
    blocks = x.reshape(rows, k // 32, 32).astype(np.float32)
    amax = np.abs(blocks).max(-1)
    inv = np.where(amax > 0, levels / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    qx = np.rint(blocks * inv[..., None])
    x_hat = qx.astype(np.float64) * (amax / levels).astype(np.float64)[..., None]
    return x_hat.reshape(rows, k) @ _np_dequantize(w, scales, biases, group, bits).T


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize(
    "rows,k", [(1, 640), (1, 576), (3, 640), (16, 576), (17, 640), (100, 576), (512, 640)]
)
def test_int8_activation_products_equal_their_numpy_scheme(int8_activations, bits: int, group: int,
                                                           rows: int, k: int):
    """Every row count, decode to prefill (several 64-row blocks), computes exactly w . x^, much closer
    to it than to the float product. K = 576 is SmolLM2's (groups of 32 and 64) and 640 a multiple of
    128 (also for groups of 128, which 576 is not a multiple of). 45 features are split over the
    threads as 16 + 16 + 13: the last 13 leave the 512-bit kernel 8 features for the 256-bit one's
    vectors and 5 for features_one_by_one."""
    k = k if k % group == 0 else 640
    rng = np.random.default_rng(bits * 100 + group + rows + k)
    features = 45
    weight = mx.array(rng.standard_normal((features, k)).astype(np.float32))
    w, scales, biases = mx.quantize(weight, group, bits)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, :32] = 0.0  # an all-zero block: scale 0, no division by it
    out = np.array(cpu_kernels.quantized_matmul(mx.array(x), w, scales, biases, group, bits))
    want = _np_int8_product(x, w, scales, biases, group, bits)
    scale = np.abs(want).max()
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * scale)
    exact = x.astype(np.float64) @ _np_dequantize(w, scales, biases, group, bits).T
    # x's rounding: ~1e-2 of the product for int8, ~1e-4 for int16; the kernel's own float32 rounding
    # ~1e-7. So the kernel is far closer to the scheme than to the float product: it took the int path.
    rounding = np.abs(want - exact).max()
    assert rounding < (2e-4 if bits == 8 else 0.03) * scale
    assert np.abs(out - want).max() < rounding / 10


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("x_kind", ["int8", "int16"])
def test_integer_builds_give_the_same_bits(native, bits: int, group: int, x_kind: str):
    """The 512-bit kernel (where this CPU has AVX-512 VNNI), the 256-bit VNNI one and plain AVX2 compute
    every product bit for bit alike, at every row count, and a feature's output is the same whether a
    lane of a 16- or 8-feature vector or the one-by-one loop computes it: an answer whose top tokens
    are close does not change with the machine's vector width or the product's feature count. (45
    features are split over the threads as 16 + 16 + 13, the 13 as 8 in a vector and 5 one by one; 37
    as 16 + 16 + 5, those 5 one by one.) Widths of 20 and 18 blocks of 32: a single row's 4-bit
    products take four blocks at a time, the last two of 18 on their own."""
    for k in (640, 576) if 576 % group == 0 else (640,):
        _check_builds_agree(bits, group, x_kind, k)


def _check_builds_agree(bits: int, group: int, x_kind: str, k: int) -> None:
    rng = np.random.default_rng(bits + group + k)
    weight = mx.array(rng.standard_normal((45, k)).astype(np.float32))
    w, scales, biases = mx.quantize(weight, group, bits)
    x = mx.array(rng.standard_normal((100, k)).astype(np.float32))
    outs = {}
    builds = (x_kind, f"{x_kind}-256", f"{x_kind}-avx2")
    for kind in builds:
        cpu_kernels.set_activations(kind)
        try:
            outs[kind] = [np.array(cpu_kernels.quantized_matmul(x[:rows], w, scales, biases, group, bits))
                          for rows in (1, 2, 3, 4, 5, 6, 7, 16, 100)]
            first_37 = cpu_kernels.quantized_matmul(x[:16], w[:37], scales[:37], biases[:37], group, bits)
            np.testing.assert_array_equal(np.array(first_37), outs[kind][7][:, :37])
        finally:
            cpu_kernels.set_activations("float32")
    for kind in builds[1:]:
        for got, want in zip(outs[x_kind], outs[kind]):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 128])
@pytest.mark.parametrize("kind", ["int16", "int8", "int16-256", "int8-avx2", "float32"])
def test_float16_scales_give_the_bits_of_their_float32_widening(native, bits: int, group: int, kind: str):
    """Scales and biases kept float16 (as GGUF Q4_1/Q8_0 and half-precision checkpoints hold them) are
    widened as the kernels read them: every build gives the same bits as with the same values in float32.
    45 features leave lanes to the 8-feature vectors and the one-by-one loop; K = 640 is 20 groups of 32
    (two loads of 8 columns and a tail of 4) or 5 of 128 (a tail only)."""
    rng = np.random.default_rng(bits + group)
    k = 640
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((45, k)).astype(np.float32)), group, bits)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = mx.array(rng.standard_normal((100, k)).astype(np.float32))
    cpu_kernels.set_activations(kind)
    try:
        for rows in (1, 3, 16, 100):
            half = cpu_kernels.quantized_matmul(x[:rows], w, scales, biases, group, bits)
            wide = cpu_kernels.quantized_matmul(
                x[:rows], w, scales.astype(mx.float32), biases.astype(mx.float32), group, bits
            )
            np.testing.assert_array_equal(np.array(half), np.array(wide))
        exact = np.array(x, dtype=np.float64) @ _np_dequantize(w, scales, biases, group, bits).T
        np.testing.assert_allclose(np.array(half), exact, rtol=0, atol=0.05 * np.abs(exact).max())
    finally:
        cpu_kernels.set_activations("float32")


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_embed_rows_equal_mlx_dequantize_of_the_gathered_rows(native, bits: int, group: int, scale_dtype):
    """The lookup of a quantized embedding table (SmolLM2's tied 8-bit one) in one op gives the bits of
    MLX's gather + dequantize with the scales widened to float32; an id outside the table, zeros."""
    rng = np.random.default_rng(bits + group)
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((300, 192)).astype(np.float32)), group, bits)
    scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
    ids = mx.array([[0, 5, 299], [7, 7, 100]])
    want = mx.dequantize(
        w[ids], scales=scales[ids].astype(mx.float32), biases=biases[ids].astype(mx.float32),
        group_size=group, bits=bits,
    )
    got = cpu_kernels.embed_rows(ids, w, scales, biases, group, bits)
    assert got.shape == (2, 3, 192) and got.dtype == mx.float32
    np.testing.assert_array_equal(np.array(got), np.array(want))
    outside = cpu_kernels.embed_rows(mx.array([300, -1, 5]), w, scales, biases, group, bits)
    assert not np.array(outside[:2]).any()
    np.testing.assert_array_equal(np.array(outside[2]), np.array(want[0, 1]))


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("scale_dtype", [mx.float16, mx.float32])
def test_amx_tiles_give_the_bits_of_the_512_bit_kernel(native, bits: int, group: int, scale_dtype):
    """Where the CPU and the OS give AMX tiles, a decode step's 12-16 rows take their dot products from
    tile multiplies: int16 and int8 x give the same bits as the 512-bit vpdpbusd kernel at the row
    counts around the tiles' (11 and 17 are not theirs). 45 features: two 16-feature tiles and a tail;
    K = 576: 9 pairs of blocks, a group of 64 spanning a pair."""
    cpu_kernels.set_activations("int8")
    try:
        if cpu_kernels.activations() != "int8-amx":
            pytest.skip(f"no AMX tiles here (the int8 build is {cpu_kernels.activations()})")
        rng = np.random.default_rng(bits + group)
        k = 576
        weight = mx.array(rng.standard_normal((45, k)).astype(np.float32))
        w, scales, biases = mx.quantize(weight, group, bits)
        scales, biases = scales.astype(scale_dtype), biases.astype(scale_dtype)
        x = mx.array(rng.standard_normal((17, k)).astype(np.float32))
        for tiles, vectors in (("int16", "int16-avx512"), ("int8", "int8-avx512")):
            for rows in (11, 12, 13, 16, 17):
                outs = []
                for kind in (tiles, vectors):
                    cpu_kernels.set_activations(kind)
                    out = cpu_kernels.quantized_matmul(x[:rows], w, scales, biases, group, bits)
                    outs.append(np.array(out))
                np.testing.assert_array_equal(outs[0], outs[1], err_msg=f"{tiles}, {rows} rows")
    finally:
        cpu_kernels.set_activations("float32")


@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 17, 100])
def test_int16_activation_products_equal_their_numpy_scheme(int16_activations, group: int, rows: int):
    """The opt-in int16 activations: 4-bit weights meet x quantized to int16 (one row, 4-row tiles
    and their remainder, two 64-row blocks) and each product is exactly w . x^ for that x^, which
    int8 x (~1e-2 of the product away) and float32 x (~1e-4) are not."""
    rng = np.random.default_rng(group + rows)
    k, features = 640, 37
    weight = mx.array(rng.standard_normal((features, k)).astype(np.float32))
    w, scales, biases = mx.quantize(weight, group, 4)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    x[0, 32:64] = 0.0  # an all-zero block (the second of a pair): scale 0, no division by it
    out = np.array(cpu_kernels.quantized_matmul(mx.array(x), w, scales, biases, group, 4))
    want = _np_int8_product(x, w, scales, biases, group, 4, wide=True)
    scale = np.abs(want).max()
    np.testing.assert_allclose(out, want, rtol=0, atol=2e-6 * scale)
    rounding = np.abs(want - x.astype(np.float64) @ _np_dequantize(w, scales, biases, group, 4).T).max()
    assert rounding < 2e-4 * scale
    assert np.abs(out - want).max() < rounding / 10  # not float32 activations either


@pytest.mark.parametrize("bits", [4, 8])
def test_int8_product_rows_do_not_depend_on_the_other_rows(integer_activations, bits: int):
    """A row's output is the same bits alone, in a decode-sized batch or in a prefill of hundreds of
    rows, wherever it sits among them: what a prefix-cache hit, a chunked prefill or a busy batch
    change is only which rows a product has."""
    rng = np.random.default_rng(bits)
    k, features = 576, 200
    w, scales, biases = mx.quantize(mx.array(rng.standard_normal((features, k)).astype(np.float32)), 32, bits)
    x = rng.standard_normal((512, k)).astype(np.float32)

    def product(rows: np.ndarray) -> np.ndarray:
        return np.array(cpu_kernels.quantized_matmul(mx.array(rows), w, scales, biases, 32, bits))

    full = product(x)
    spans = ((0, 1), (511, 1), (9, 2), (5, 3), (20, 5), (30, 6), (64, 16), (100, 17), (200, 100), (3, 509))
    for start, count in spans:
        np.testing.assert_array_equal(product(x[start:start + count]), full[start:start + count])
    others = rng.standard_normal((40, k)).astype(np.float32)
    mixed = product(np.concatenate([others[:21], x[7:8], others[21:]]))
    np.testing.assert_array_equal(mixed[21], full[7])


_MANY_THREADS_SCRIPT = """
import sys
import mlx_infer
import mlx.core as mx
import numpy as np
from mlx_infer import cpu_kernels

assert cpu_kernels.available(), cpu_kernels.unavailable_reason()
rng = np.random.default_rng(0)
outs = []
for i in range(300):
    features, k, bits = int(rng.integers(1, 700)), 64 * int(rng.integers(1, 10)), (4, 8)[i % 2]
    w, s, b = mx.quantize(mx.array(rng.standard_normal((features, k)).astype(np.float32)), 32, bits)
    x = mx.array(rng.standard_normal((1 + i % 3, k)).astype(np.float32))
    outs.append(np.array(cpu_kernels.quantized_matmul(x, w, s, b, 32, bits)).ravel())
np.save(sys.argv[1], np.concatenate(outs))
"""


def test_products_split_over_more_threads_than_cores_are_unchanged(native, tmp_path: Path):
    """Seven kernel threads on this machine's cores: workers are often descheduled or still waking
    when a product starts, so the caller takes most chunks and a job closes with some workers never
    joining. 300 products of random shapes must equal those of one thread (no split), bit for bit:
    a feature's arithmetic does not depend on which thread computes it."""
    def products(threads: int) -> np.ndarray:
        out_path = tmp_path / f"threads_{threads}.npy"
        env = {**os.environ, "MLX_INFER_CPU_THREADS": str(threads)}
        run = subprocess.run([sys.executable, "-c", _MANY_THREADS_SCRIPT, str(out_path)], env=env,
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        return np.load(out_path)

    np.testing.assert_array_equal(products(7), products(1))


def test_int8_activations_leave_products_they_do_not_fit_exact(int8_activations):
    """K not a multiple of 64 keeps float32 activations, for a few rows (the fused matvec) and many
    (the BLAS tiles)."""
    rng = np.random.default_rng(5)
    for rows in (1, 17):
        w, scales, biases = mx.quantize(mx.array(rng.standard_normal((40, 96)).astype(np.float32)), 32, 4)
        x = mx.array(rng.standard_normal((rows, 96)).astype(np.float32))
        want = np.array(x, dtype=np.float64) @ _np_dequantize(w, scales, biases, 32, 4).T
        out = cpu_kernels.quantized_matmul(x, w, scales, biases, 32, 4)
        np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-4)


def test_activation_kinds_are_checked(native, monkeypatch: pytest.MonkeyPatch):
    with pytest.raises(ValueError, match="int8|float32"):
        cpu_kernels.set_activations("int4")
    with pytest.raises(ValueError, match="activations must be"):
        native.set_activations("int4")
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_ENV_VAR, "bogus")
    cpu_kernels._apply_activations_env()  # a warning, then the default
    assert cpu_kernels.activations() == "int16"
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_ENV_VAR, "int8")
    cpu_kernels._apply_activations_env()
    assert cpu_kernels.activations().startswith("int8")
    monkeypatch.setenv(cpu_kernels.ACTIVATIONS_ENV_VAR, "float32")
    cpu_kernels._apply_activations_env()
    assert cpu_kernels.activations() == "float32"


def test_cpu_activations_flag_of_generate_serve_and_launch(native, capsys, monkeypatch: pytest.MonkeyPatch):
    """``--cpu-activations`` sets the kind before the model loads, is checked by argparse, and launch
    passes it to every rank as the environment variable."""
    parser = cli.build_parser()
    for command in ("generate", "serve"):
        args = parser.parse_args([command, "-m", "M", "--cpu-activations", "int16"])
        try:
            cli_options.apply_cpu_activations(args)
            assert cpu_kernels.activations() == "int16"
        finally:
            cpu_kernels.set_activations("float32")
        cli_options.apply_cpu_activations(parser.parse_args([command, "-m", "M"]))  # unset: unchanged
        assert cpu_kernels.activations() == "float32"
    with pytest.raises(SystemExit) as bad:
        parser.parse_args(["generate", "-m", "M", "--cpu-activations", "int4"])
    assert bad.value.code == 2 and "invalid choice: 'int4'" in capsys.readouterr().err
    monkeypatch.delenv(cpu_kernels.ACTIVATIONS_ENV_VAR, raising=False)
    hosts = ["--hosts", "127.0.0.1,127.0.0.1", "--dry-run"]
    assert launch.main([*hosts, "--cpu-activations", "int16", "--", "generate", "-m", "M"]) == 0
    commands = [line for line in capsys.readouterr().out.splitlines() if line.startswith("bash -c")]
    assert len(commands) == 2 and all("export MLX_INFER_CPU_ACTIVATIONS=int16;" in c for c in commands)
    assert launch.main([*hosts, "--", "generate", "-m", "M"]) == 0
    assert "MLX_INFER_CPU_ACTIVATIONS" not in capsys.readouterr().out


@pytest.mark.slow
def test_generate_on_the_default_activations_answers_the_readme_prompt_as_float32_does(
        smollm2_path, capsys, monkeypatch: pytest.MonkeyPatch):
    """The README's France prompt, whose first token's margin is 0.08 nats on the exact path ("The" over
    "L") and which int8 activations can overturn ("L'Étoile...", as llama.cpp answers), gets float32's
    answer on the activations a user's process starts with (int16)."""
    monkeypatch.delenv(cpu_kernels.ACTIVATIONS_ENV_VAR, raising=False)
    cpu_kernels._apply_activations_env()
    argv = ["generate", "-m", str(smollm2_path), "-p", "What is the capital of France?", "--max-tokens", "8"]
    try:
        assert cpu_kernels.activations() == "int16"
        assert cli.main(argv) == 0
    finally:
        cpu_kernels.set_activations("float32")
    assert "The capital of France is Paris" in capsys.readouterr().out


def test_bad_arguments_raise_one_clear_error(native):
    w, s, b = mx.quantize(mx.zeros((8, 64)), 32, 4)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        native.affine_qmv(mx.ones((1, 64)), w, s, b, 32, 3)
    with pytest.raises(ValueError, match="shapes"):
        native.affine_qmv(mx.ones((1, 96)), w, s, b, 32, 4)
    with pytest.raises(ValueError, match="float32"):
        native.affine_qmv(mx.ones((1, 64)), w, s.astype(mx.float16), b, 32, 4)


@pytest.mark.parametrize("vocab", [1, 7, 8, 61, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_argmax_gives_mlx_argmax_indices(native, rows: int, vocab: int):
    """Greedy sampling's native argmax answers as mx.argmax (and NumPy) do: the first of equal maxima
    (integer-valued logits tie often; a tie between a lane's and the tail's values), the first NaN of a
    row that has any, 0 for a row of -inf, the first +inf; rows alone, few (one thread) or many (the pool)."""
    rng = np.random.default_rng(rows * 100_003 + vocab)
    x = np.round(rng.standard_normal((rows, vocab)) * 2).astype(np.float32)
    cases = [x, x.copy(), x.copy(), x.copy()]
    cases[1][:, vocab // 2 :] = -np.inf
    cases[1][-1] = -np.inf
    cases[2][rng.random((rows, vocab)) < 0.05] = np.nan
    cases[2][0, -1] = np.nan
    cases[3][rng.random((rows, vocab)) < 0.05] = np.inf
    for case in cases:
        got = np.array(cpu_kernels.argmax(mx.array(case)))
        np.testing.assert_array_equal(got, np.array(mx.argmax(mx.array(case), axis=-1)))
        np.testing.assert_array_equal(got, np.argmax(case, axis=-1))


@pytest.mark.parametrize("vocab", [5, 61, 49152])
@pytest.mark.parametrize("rows", [1, 16])
def test_logprobs_equal_float64_log_softmax_and_its_top_k(native, rows: int, vocab: int):
    """The sampler's log-probabilities in one native op: the chosen tokens' log_softmax within 2e-5 of
    float64's (a float32 sum over 49152 exponentials; MLX's own logsumexp path is 5e-5 to 1e-4 off on
    these), the top k ids those of a stable sort (equal logits: the lower id first; integer-valued
    logits tie often) with their log-probabilities, k = 0 (the chosen ones only) to k = vocab."""
    rng = np.random.default_rng(rows * 7 + vocab)
    x = (rng.standard_normal((rows, vocab)) * 4).astype(np.float32)
    x[0] = np.round(x[0])
    tokens = rng.integers(0, vocab, rows).astype(np.int32)
    x64 = x.astype(np.float64)
    top = x64.max(axis=1, keepdims=True)
    want = x64 - (top + np.log(np.exp(x64 - top).sum(axis=1, keepdims=True)))
    for k in sorted({0, 1, 5, min(20, vocab), vocab if vocab < 100 else 20}):
        chosen, ids, values = (np.array(a) for a in cpu_kernels.logprobs(mx.array(x), mx.array(tokens), k))
        np.testing.assert_allclose(chosen, want[np.arange(rows), tokens], rtol=0, atol=2e-5)
        order = np.argsort(-x, axis=1, kind="stable")[:, :k]
        np.testing.assert_array_equal(ids, order)
        np.testing.assert_allclose(values, np.take_along_axis(want, order, axis=1), rtol=0, atol=2e-5)


def test_logprobs_of_nan_and_infinite_rows(native):
    """A NaN logit makes its row's log-probabilities NaN (as MLX's logsumexp does) and is never among the
    top k; a row of -inf gives -inf or NaN, never a number, and its top k fill with -inf."""
    x = np.array([[0.0, np.nan, 1.0, 2.0], [-np.inf] * 4, [1.0, 1.0, -np.inf, 0.5]], dtype=np.float32)
    chosen, ids, values = (np.array(a) for a in cpu_kernels.logprobs(mx.array(x), mx.array([2, 0, 3]), 3))
    assert np.isnan(chosen[0]) and not np.isfinite(chosen[1])
    np.testing.assert_array_equal(ids[0], [3, 2, 0])
    np.testing.assert_array_equal(ids[2], [0, 1, 3])
    np.testing.assert_allclose(chosen[2], 0.5 - np.log(2 * np.e + np.exp(0.5)), atol=2e-6)
    assert not np.isfinite(values[1]).any()


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draw_inverts_the_softmax_cdf_at_each_rows_uniform(native, temperature: float):
    """Temperature sampling as one native op: each row's token is the inverse of softmax(x / t)'s CDF at
    its uniform (float64 NumPy's, over a grid of 2000 uniforms: every token's share of the grid is its
    probability), -inf logits (cut by top-k/top-p) are never drawn, and a row at t = 0 beside them
    takes its argmax."""
    rng = np.random.default_rng(int(temperature * 10))
    x = (rng.standard_normal(61) * 2).astype(np.float32)
    x[[3, 7, 60]] = -np.inf
    uniforms = ((np.arange(2000) + 0.5) / 2000).astype(np.float32)
    logits = np.tile(x, (len(uniforms) + 1, 1))
    temps = [temperature] * len(uniforms) + [0.0]
    got = np.array(cpu_kernels.draw(mx.array(logits), temps, mx.array(np.append(uniforms, 0.5))))
    weights = np.exp((x.astype(np.float64) - x.max()) / temperature)
    want = np.searchsorted(np.cumsum(weights) / weights.sum(), uniforms.astype(np.float64), side="right")
    np.testing.assert_array_equal(got[:-1], want)
    assert got[-1] == np.argmax(x)
    assert not np.isin(got, [3, 7, 60]).any()


def _np_truncate_top(x: np.ndarray, k: int, p: float, min_p: float) -> np.ndarray:
    """Top-k, top-p, then min-p of one row in float64: rank by descending logit (equal ones by the lower
    id), keep the first k, then those whose mass ranked before them (softmax over the k) is below p, then
    those whose probability is at least min_p times the top one's."""
    order = np.argsort(-x, kind="stable")[: k or len(x)]
    probs = np.exp(x[order].astype(np.float64) - x[order[0]])
    if p < 1.0:
        order = order[(np.cumsum(probs / probs.sum()) - probs / probs.sum()) < p]
        probs = probs[: len(order)]
    order = order[probs >= min_p]
    out = np.full_like(x, -np.inf)
    out[order] = x[order]
    return out


@pytest.mark.parametrize("vocab", [7, 300, 49152])
def test_truncate_top_keeps_what_top_k_top_p_and_min_p_keep(native, vocab: int):
    """Top-k, top-p and min-p as one native op, against float64 NumPy row by row: ties (integer-valued
    logits) cut by the lower id first, top-p alone (found without sorting the whole row), top-k then
    top-p, min-p after either and alone, and a row's settings are its own: a row without any keeps every
    token beside rows with them (the MLX ops, which ran top-p over the whole batch, cut such a row's
    float32 tail once its cumulative mass rounded to 1)."""
    rng = np.random.default_rng(vocab)
    x = (rng.standard_normal((8, vocab)) * 3).astype(np.float32)
    x[1], x[7] = np.round(x[1]), np.round(x[7] / 3)  # ties; row 7's min-p 1 keeps its tied maxima
    top_k = [0, 3, 0, 50, 1, 0, 0, 4]
    top_p = [0.9, 1.0, 0.5, 0.8, 0.3, 1.0, 1.0, 1.0]
    min_p = [0.0, 0.0, 0.1, 0.05, 0.0, 0.0, 0.2, 1.0]
    got = np.array(cpu_kernels.truncate_top(mx.array(x), top_k, top_p, min_p))
    for row, settings in enumerate(zip(top_k, top_p, min_p)):
        np.testing.assert_array_equal(got[row], _np_truncate_top(x[row], *settings), err_msg=f"row {row}")
    assert np.isfinite(got[5]).all()
    assert 0 < np.isfinite(got[6]).sum() < vocab  # min-p alone cut something and kept the top


@pytest.mark.parametrize("offset", [False, True])
def test_rms_norm_equals_numpy(native, offset: bool):
    rng = np.random.default_rng(3)
    x = mx.array(rng.standard_normal((7, 96)).astype(np.float32))[::2]  # strided rows
    w = mx.array(rng.standard_normal(96).astype(np.float32))
    out = cpu_kernels.rms_norm(x, w, 1e-5, offset)
    xs = np.array(x, dtype=np.float64)
    want = xs / np.sqrt((xs**2).mean(-1, keepdims=True) + 1e-5) * (1 + np.array(w) if offset else np.array(w))
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-6)
    assert cpu_kernels.rms_norm(x.astype(mx.bfloat16), w, 1e-5) is None  # other dtypes: MLX ops


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16])
def test_kv_write_puts_rows_at_their_slots_and_keeps_a_shared_pool(native, dtype):
    pool = mx.zeros((64, 2, 8), dtype=dtype)
    rows = mx.arange(3 * 2 * 16, dtype=dtype).reshape(3, 2, 16)[:, :, ::2]  # a strided view
    slots = mx.array([7, 0, 63])
    written = cpu_kernels.kv_write(pool, rows, slots)
    assert mx.array_equal(written[slots], rows).item()
    others = mx.array([i for i in range(64) if i not in (0, 7, 63)])
    assert not mx.any(written[others]).item()
    # `pool` is still referenced here, so the write could not take its buffer: it is unchanged.
    assert not mx.any(pool).item()


def test_kv_write_in_place_writes_a_pool_whoever_holds_it(native):
    """The engine's pools are written in place always: an array of the pool from before the write reads
    the new rows (whether another holder was left depended on how far the previous step had run)."""
    pool = mx.zeros((64, 2, 8))
    mx.eval(pool)
    address = np.array(pool, copy=False).__array_interface__["data"][0]
    written = cpu_kernels.kv_write(pool, mx.ones((1, 2, 8)), mx.array([5]), in_place=True)
    mx.eval(written)
    assert np.array(written, copy=False).__array_interface__["data"][0] == address
    assert mx.array_equal(pool, written).item() and pool[5].sum().item() == 16


def test_kv_write_updates_a_donated_pool_in_place(native):
    """Rebinding the only reference lets each write reuse the pool's buffer: no copy of the pool per
    step, however large (the engine's LayerKV relies on this)."""
    pool = mx.zeros((4096, 4, 64))
    mx.eval(pool)
    address = np.array(pool, copy=False).__array_interface__["data"][0]
    row = mx.ones((1, 4, 64))
    for step in range(3):
        pool = cpu_kernels.kv_write(pool, row * step, mx.array([step]))
        mx.eval(pool)
    assert np.array(pool, copy=False).__array_interface__["data"][0] == address
    assert [pool[i, 0, 0].item() for i in range(4)] == [0.0, 1.0, 2.0, 0.0]


def _np_attention(q, keys, values, seq_of, positions, tables, context_lens, block, scale, window, softcap,
                  sinks=None):
    """Float64 attention read straight from the paged pools, one query at a time; ``sinks`` ([H]) join
    each softmax's denominator."""
    q, keys, values = (np.array(a, dtype=np.float64) for a in (q, keys, values))
    n_tokens, n_heads, _ = q.shape
    rep = n_heads // keys.shape[1]
    out = np.zeros_like(q)
    for t in range(n_tokens):
        seq, pos = seq_of[t], positions[t]
        visible = [j for j in range(context_lens[seq]) if j <= pos and (window is None or j > pos - window)]
        slots = [tables[seq][j // block] * block + j % block for j in visible]
        for h in range(n_heads):
            k, v = keys[slots, h // rep], values[slots, h // rep]
            scores = k @ q[t, h] * scale
            if softcap is not None:
                scores = np.tanh(scores / softcap) * softcap
            top = scores.max(initial=-np.inf if sinks is None else sinks[h])
            p = np.exp(scores - top)
            denominator = p.sum() + (0.0 if sinks is None else np.exp(sinks[h] - top))
            out[t, h] = (p / denominator) @ v if len(visible) else 0.0
    return out


def _attention_step(shapes, n_heads, n_kv, head_dim, rng):
    """Pools, block tables (permuted across the pool) and queries for sequences of (tokens already
    cached, new tokens): (tables, keys, values, q)."""
    block = 16
    needed = [-(-(c + n) // block) for c, n in shapes]
    physical = rng.permutation(sum(needed) + 3)  # spare blocks stay unused
    tables, at = [], 0
    for n in needed:
        tables.append(physical[at : at + n].tolist())
        at += n
    slots = (len(physical)) * block
    keys = mx.array(rng.standard_normal((slots, n_kv, head_dim)).astype(np.float32))
    values = mx.array(rng.standard_normal((slots, n_kv, head_dim)).astype(np.float32))
    n_tokens = sum(n for _, n in shapes)
    q = mx.array(rng.standard_normal((n_tokens, n_heads, head_dim)).astype(np.float32))
    return tables, keys, values, q


def _check_attention(shapes, n_heads, n_kv, head_dim, window, softcap, seed, sinks=None):
    """The kernel against _np_attention."""
    block = 16
    tables, keys, values, q = _attention_step(shapes, n_heads, n_kv, head_dim, np.random.default_rng(seed))
    meta = build_metadata([SequenceSlice(table, c, n) for table, (c, n) in zip(tables, shapes)], block)
    scale = head_dim**-0.5
    sink_array = None if sinks is None else mx.array(sinks)
    out = cpu_kernels.paged_attention(q, keys, values, meta, scale, window, softcap, sink_array)
    seq_of = np.repeat(np.arange(len(shapes)), [n for _, n in shapes])
    want = _np_attention(q, keys, values, seq_of, np.array(meta.positions), tables,
                         [c + n for c, n in shapes], block, scale, window, softcap, sinks)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize(
    "n_heads,n_kv,head_dim,window,softcap",
    [(4, 4, 64, None, None), (6, 2, 80, None, None), (8, 2, 128, None, None), (3, 1, 64, 7, None),
     (4, 2, 64, None, 30.0), (10, 2, 72, None, None)],
)
def test_paged_attention_equals_numpy(native, n_heads, n_kv, head_dim, window, softcap):
    """A ragged step over permuted block tables: decodes at contexts 1, 15, 16, 17 and 300, and a
    prefill chunk of 5 tokens after 20 cached ones."""
    shapes = [(0, 1), (14, 1), (15, 1), (16, 1), (299, 1), (20, 5)]
    _check_attention(shapes, n_heads, n_kv, head_dim, window, softcap, seed=n_heads * 100 + head_dim)


@pytest.mark.parametrize(
    "shapes,window,softcap",
    [([(599, 1)], None, None), ([(599, 1), (40, 1)], None, None), ([(1000, 1)], 300, None),
     ([(700, 1)], None, 30.0), ([(130, 1)], None, None)],
)
def test_paged_attention_of_a_few_decodes_splits_keys_and_merges(native, shapes, window, softcap):
    """SmolLM2's heads (9 query, 3 KV) at batch 1-2: fewer tokens than the threads share evenly, so
    each one's chunks of keys are separate tasks whose partial softmaxes are merged."""
    _check_attention(shapes, 9, 3, 64, window, softcap, seed=len(shapes) * 1000 + shapes[0][0])


@pytest.mark.parametrize(
    "shapes,window,softcap",
    [([(0, 1), (14, 1), (299, 1), (20, 5)], None, None), ([(599, 1)], None, None),
     ([(299, 1), (40, 9)], 7, None), ([(130, 1), (20, 5)], 50, 30.0)],
)
def test_paged_attention_with_sinks_equals_numpy(native, shapes, window, softcap):
    """gpt-oss's per-head sinks join the denominator once per query, however the keys are chunked and
    merged (batch 1 at 600 keys: ten chunks of separate tasks); sinks above and below every score."""
    sinks = np.array([-2.0, 0.5, 3.0, 9.0, -30.0, 1.0], dtype=np.float32)
    _check_attention(shapes, 6, 2, 64, window, softcap, seed=len(shapes) * 10 + shapes[0][0], sinks=sinks)


def test_paged_attention_sinks_take_weight_from_the_keys(native):
    """A sink far above every score leaves almost nothing to the values, one far below changes nothing:
    the test above would pass for a kernel that ignored sinks only if they were all very negative."""
    tables, keys, values, q = _attention_step([(30, 2)], 2, 1, 32, np.random.default_rng(3))
    meta = build_metadata([SequenceSlice(tables[0], 30, 2)], 16)
    plain = np.array(cpu_kernels.paged_attention(q, keys, values, meta, 0.2))
    low = np.array(cpu_kernels.paged_attention(q, keys, values, meta, 0.2, sinks=mx.array([-80.0, -80.0])))
    high = np.array(cpu_kernels.paged_attention(q, keys, values, meta, 0.2, sinks=mx.array([40.0, 0.0])))
    np.testing.assert_array_equal(low, plain)
    assert np.abs(high[:, 0]).max() < 1e-6 and np.abs(high[:, 1] - plain[:, 1]).max() > 1e-3


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16, mx.int8])
@pytest.mark.parametrize("n_heads,n_kv,head_dim,value_dim", [(9, 3, 64, 0), (4, 2, 72, 0), (2, 1, 80, 0),
                                                              (8, 8, 128, 0), (4, 1, 96, 40)])
def test_paged_attention_vector_widths_give_the_same_bits(native, dtype, n_heads, n_kv, head_dim, value_dim):
    """The 512-bit passes (where this CPU has AVX-512) and the 256-bit ones compute every output bit for
    bit alike: head dims with 8 values past a multiple of 16, 1-3 query rows a KV head, decodes whose
    last chunk holds 1-15 keys, a prefill group, and MLA's values as the first value_dim of the rows."""
    if native.attention_vectors() != 512:
        pytest.skip("this CPU has no AVX-512")
    shapes = [(0, 1), (14, 1), (17, 1), (63, 1), (130, 1), (299, 1), (20, 9)]
    rng = np.random.default_rng(head_dim)
    tables, keys, values, q = _attention_step(shapes, n_heads, n_kv, head_dim, rng)
    keys, values = pool_rows(keys, dtype), pool_rows(values, dtype)
    if value_dim:
        values = keys  # the latent rows serve as both
    meta = build_metadata([SequenceSlice(table, c, n) for table, (c, n) in zip(tables, shapes)], 16)
    outs = {}
    for bits in (512, 256):
        native.set_attention_vectors(bits)
        try:
            outs[bits] = np.array(cpu_kernels.paged_attention(q, keys, values, meta, head_dim**-0.5,
                                                              value_dim=value_dim))
        finally:
            native.set_attention_vectors(512)
    np.testing.assert_array_equal(outs[512], outs[256])
    with pytest.raises(ValueError, match="256 bits"):
        native.set_attention_vectors(128)


@pytest.mark.parametrize("window", [None, 100])
def test_paged_attention_of_a_query_does_not_depend_on_the_step(native, window):
    """A query's output is the same bits computed alone (its key chunks spread over the threads) and
    in a step of 100 tokens beside decodes and prefill chunks of other sequences (each token one
    task): a request's attention does not change with the batch it lands in."""
    shapes = [(599, 1), (40, 1), (130, 1), (200, 70), (0, 20), (63, 1), (64, 1), (1000, 1), (5, 4)]
    tables, keys, values, q = _attention_step(shapes, 9, 3, 64, np.random.default_rng(7))
    scale = 64**-0.5

    def attend(indices: list[int], queries: mx.array) -> np.ndarray:
        meta = build_metadata([SequenceSlice(tables[i], *shapes[i]) for i in indices], 16)
        return np.array(cpu_kernels.paged_attention(queries, keys, values, meta, scale, window))

    together = attend(list(range(len(shapes))), q)
    first = np.cumsum([0] + [n for _, n in shapes])
    for i in range(len(shapes)):
        rows = slice(first[i], first[i + 1])
        np.testing.assert_array_equal(attend([i], q[rows]), together[rows])
        if shapes[i][1] > 1:  # its last query, alone: a decode step at the same position
            last = slice(first[i + 1] - 1, first[i + 1])
            meta_shape = (shapes[i][0] + shapes[i][1] - 1, 1)
            meta = build_metadata([SequenceSlice(tables[i], *meta_shape)], 16)
            alone = np.array(cpu_kernels.paged_attention(q[last], keys, values, meta, scale, window))
            np.testing.assert_array_equal(alone, together[last])


def test_kernels_can_be_turned_off(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLX_INFER_CPU_KERNELS", "off")
    with pytest.raises(build.Unavailable, match="MLX_INFER_CPU_KERNELS=off"):
        build.load()
    monkeypatch.delenv("MLX_INFER_CPU_KERNELS")
    monkeypatch.setenv("MLX_INFER_KERNELS", "reference")
    with pytest.raises(build.Unavailable, match="reference"):
        build.load()


def test_missing_cmake_is_one_reason_not_a_crash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))  # an empty cache: a build is needed
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    with pytest.raises(build.Unavailable, match="cmake not found"):
        build.load()


@pytest.mark.slow
def test_smollm2_greedy_tokens_through_the_kernels_equal_float32(smollm2_path):
    """The real model: 4-bit weights through the kernels give the greedy tokens of the same weights
    dequantized to float32 and multiplied by the BLAS (three prompts decoded in one batch)."""
    prompts = ["The capital of France is", "def fibonacci(n):", "Water boils at"]
    kernels = load(str(smollm2_path))
    assert "native CPU kernels" in kernels.weight_policy
    plain = load(str(smollm2_path), keep_quantized=False)
    assert "dequantized" in plain.weight_policy
    assert _greedy(kernels, prompts, 24) == _greedy(plain, prompts, 24)


def _greedy(lm, prompts: list[str], max_tokens: int) -> list[list[int]]:
    engine = Engine(lm.model, lm.tokenizer, 2048, EngineConfig(num_blocks=32))
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    ids = [engine.add_request(lm.tokenizer.encode(p), params) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    return [out[i] for i in ids]
