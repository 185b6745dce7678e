"""BLAS binding (mlx_infer/blas.py).

Each case runs in a fresh interpreter because the binding only works before ``mlx.core`` is
imported. Which library MLX really calls is read from the dynamic linker's own trace
(``LD_DEBUG=bindings``), an oracle independent of what ``blas.active()`` claims.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="BLAS binding is Linux-only")

# Computes x @ w.T through MLX for the saved inputs; prints blas.active() and the result's path.
SCRIPT = """
import json, sys
import numpy as np
from mlx_infer import blas
import mlx.core as mx
x, w = (mx.array(np.load(sys.argv[1] + name)) for name in ("/x.npy", "/w.npy"))
out = np.array(x @ w.T)
np.save(sys.argv[2], out)
print(json.dumps({"active": blas.active()}))
"""


def _run(
    tmp_path: Path, tag: str, blas_env: str | None, prelude: str = ""
) -> tuple[dict, str, str, np.ndarray]:
    """Run SCRIPT in a subprocess: (its json, stderr, the library libmlx binds cblas_sgemm to, result)."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_INFER_BLAS"}
    if blas_env is not None:
        env["MLX_INFER_BLAS"] = blas_env
    trace = tmp_path / f"ld-{tag}"
    env.update(LD_DEBUG="bindings", LD_DEBUG_OUTPUT=str(trace))
    out_path = tmp_path / f"out-{tag}.npy"
    proc = subprocess.run(
        [sys.executable, "-c", prelude + SCRIPT, str(tmp_path), str(out_path)],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    bound = [
        line.split(" to ")[1].split(" [")[0]
        for f in tmp_path.glob(f"ld-{tag}.*")
        for line in f.read_text().splitlines()
        if "libmlx.so [" in line and "`cblas_sgemm'" in line
    ]
    assert len(bound) == 1, bound
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, bound[0], np.load(out_path)


@pytest.fixture
def inputs(tmp_path: Path) -> np.ndarray:
    """SmolLM2-shaped float32 operands (64 rows x 576 -> 1536); returns the float64 oracle."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((64, 576)).astype(np.float32)
    w = rng.standard_normal((1536, 576)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "w.npy", w)
    return x.astype(np.float64) @ w.astype(np.float64).T


def _is_reference(library: str) -> bool:
    return "mlx_cpu.libs" in library and "libblas" in Path(library).name


def test_accelerated_agrees_with_reference(tmp_path: Path, inputs: np.ndarray) -> None:
    fast, _, fast_lib, fast_out = _run(tmp_path, "auto", None)
    if fast["active"].startswith("reference"):
        pytest.skip(f"no optimized BLAS on this machine: {fast['active']}")
    ref, _, ref_lib, ref_out = _run(tmp_path, "off", "off")
    assert not _is_reference(fast_lib) and fast_lib in fast["active"], (fast_lib, fast["active"])
    assert _is_reference(ref_lib), ref_lib
    # float32 dot products of length 576 with O(1) terms: absolute error ~1e-5 against float64.
    np.testing.assert_allclose(ref_out, inputs, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(fast_out, inputs, rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(fast_out, ref_out, rtol=1e-5, atol=1e-4)


def test_off_leaves_reference_blas(tmp_path: Path, inputs: np.ndarray) -> None:
    info, stderr, library, _ = _run(tmp_path, "off", "off")
    assert info["active"] == "reference BLAS (MLX_INFER_BLAS=off)"
    assert _is_reference(library), library
    assert stderr == ""


def test_bogus_path_warns_once_and_falls_back(tmp_path: Path, inputs: np.ndarray) -> None:
    bogus = str(tmp_path / "no-such-libblas.so")
    info, stderr, library, out = _run(tmp_path, "bogus", bogus)
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "MLX_INFER_BLAS" in lines[0] and bogus in lines[0], stderr
    assert "reference" in lines[0]
    assert info["active"].startswith("reference BLAS")
    assert _is_reference(library), library
    np.testing.assert_allclose(out, inputs, rtol=1e-5, atol=1e-4)


def test_library_without_cblas_is_refused(tmp_path: Path, inputs: np.ndarray) -> None:
    # libm loads fine but exports no CBLAS: it must not enter the global symbol scope.
    info, stderr, library, _ = _run(tmp_path, "libm", "libm.so.6")
    assert "does not export cblas_sgemm" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert info["active"].startswith("reference BLAS")
    assert _is_reference(library), library


def test_mlx_imported_first_is_reported(tmp_path: Path, inputs: np.ndarray) -> None:
    info, _, library, _ = _run(tmp_path, "late", None, prelude="import mlx.core\n")
    assert "imported before mlx_infer" in info["active"]
    assert _is_reference(library), library


# Every CBLAS function libmlx imports, through MLX, against NumPy in float64/complex128; then the thread
# count numpy's OpenBLAS really has (asked from the library, not from blas.active()).
SHIM_SCRIPT = """
import ctypes, glob, json, os
import numpy as np
from mlx_infer import blas
import mlx.core as mx
rng = np.random.default_rng(0)
errors = {}
for name, dtype, mx_dtype in (("sgemm", np.float32, mx.float32), ("dgemm", np.float64, mx.float64),
                              ("cgemm", np.complex64, mx.complex64)):
    a, b = (rng.standard_normal(s) + (1j * rng.standard_normal(s) if name == "cgemm" else 0) for s in
            ((64, 96), (96, 48)))
    for x, w in ((a, b), (a[:1], b), (a, b[:, :1])):  # a matrix, one row, one column (sgemv in the shim)
        x_, w_ = (mx.array(v.astype(dtype), dtype=mx_dtype) for v in (x, w))  # float64 needs asking for
        xt, wt = (mx.array(v.T.astype(dtype), dtype=mx_dtype) for v in (x, w))
        exact = x.astype(dtype).astype(np.complex128) @ w.astype(dtype).astype(np.complex128)
        for left, right in ((x_, w_), (xt.T, w_), (x_, wt.T), (xt.T, wt.T)):  # each operand transposed
            out = np.array(mx.matmul(left, right, stream=mx.cpu))
            error = float(np.abs(out - exact).max() / np.abs(exact).max())
            errors[name] = max(errors.get(name, 0.0), error)
libs = os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs")
lib = ctypes.CDLL(glob.glob(os.path.join(libs, "*openblas64_*"))[0])
get = getattr(lib, "scipy_openblas_get_num_threads64_", None) or lib.openblas_get_num_threads64_
print(json.dumps({"active": blas.active(), "errors": errors, "threads": get()}))
"""


def _run_shim(tmp_path: Path, **env_overrides: str) -> tuple[dict, str, dict[str, str]]:
    """SHIM_SCRIPT with MLX_INFER_BLAS=numpy and an empty cache: (its json, stderr, symbol -> library)."""
    env = {k: v for k, v in os.environ.items() if k != "OPENBLAS_NUM_THREADS"}
    env.update(MLX_INFER_BLAS="numpy", MLX_INFER_CACHE=str(tmp_path / "cache"), LD_DEBUG="bindings",
               LD_DEBUG_OUTPUT=str(tmp_path / "ld"), **env_overrides)
    proc = subprocess.run([sys.executable, "-c", SHIM_SCRIPT], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    bound = {}
    for f in tmp_path.glob("ld.*"):
        for line in f.read_text().splitlines():
            for name in ("cblas_sgemm", "cblas_dgemm", "cblas_cgemm"):
                if "libmlx.so [" in line and f"`{name}'" in line:
                    bound[name] = line.split(" to ")[1].split(" [")[0]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr, bound


@pytest.mark.skipif(not list((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas64_*")),
                    reason="this numpy bundles no OpenBLAS")
def test_numpy_openblas_through_the_shim(tmp_path: Path) -> None:
    """What a plain install (no MKL, no system OpenBLAS) binds: numpy's own OpenBLAS, through the shim
    compiled on first use; every product MLX hands to BLAS, in one thread unless OPENBLAS_NUM_THREADS."""
    info, stderr, bound = _run_shim(tmp_path)
    assert info["active"].startswith("numpy's OpenBLAS") and "OPENBLAS_NUM_THREADS=1" in info["active"], info
    shims = list((tmp_path / "cache" / "blas").glob("libmlx_infer_cblas-*.so"))
    assert len(shims) == 1 and bound == dict.fromkeys(bound, str(shims[0])) and len(bound) == 3, bound
    # Relative to the largest entry: float32/complex64 rounding over 96 terms, float64 far below.
    assert info["errors"]["sgemm"] < 1e-5 and info["errors"]["cgemm"] < 1e-5, info["errors"]
    assert info["errors"]["dgemm"] < 1e-12, info["errors"]
    assert info["threads"] == 1 and stderr == ""

    info, _, _ = _run_shim(tmp_path, OPENBLAS_NUM_THREADS="2")  # the user's setting wins; shim cached
    assert info["threads"] == 2 and "OPENBLAS_NUM_THREADS=2" in info["active"]


@pytest.mark.skipif(not list((Path(np.__file__).parent.parent / "numpy.libs").glob("*openblas64_*")),
                    reason="this numpy bundles no OpenBLAS")
def test_shim_sgemm_every_layout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shim's sgemm (its sgemv shortcuts for one row or column included) against NumPy, called
    directly: row- and column-major, each operand transposed or not, padded leading dimensions, beta."""
    import ctypes

    from mlx_infer import blas

    monkeypatch.setenv("MLX_INFER_CACHE", str(tmp_path))
    library = ctypes.CDLL(blas.numpy_openblas())  # loaded locally here: MLX in this process is untouched
    prefix = "scipy_" if hasattr(library, "scipy_cblas_sgemm64_") else ""
    shim = blas.load_shim(library, prefix)[0]
    f32p = np.ctypeslib.ndpointer(np.float32)
    shim.cblas_sgemm.argtypes = [ctypes.c_int] * 6 + [ctypes.c_float, f32p, ctypes.c_int, f32p, ctypes.c_int,
                                                      ctypes.c_float, f32p, ctypes.c_int]
    rng = np.random.default_rng(0)

    def stored(logical: np.ndarray, row_major: bool) -> tuple[np.ndarray, int]:
        """``logical`` laid out in memory as BLAS reads it, with 3 unused values after each row/column."""
        mat = logical if row_major else logical.T
        buf = np.zeros((mat.shape[0], mat.shape[1] + 3), np.float32)
        buf[:, : mat.shape[1]] = mat
        return buf, buf.shape[1]

    for order, ta, tb, (m, n, k) in itertools.product((101, 102), (111, 112), (111, 112),
                                                       ((1, 7, 5), (6, 1, 5), (1, 1, 5), (4, 3, 5))):
        row_major = order == 101
        op_a, op_b = rng.standard_normal((m, k)), rng.standard_normal((k, n))
        c0 = rng.standard_normal((m, n))
        a, lda = stored(op_a if ta == 111 else op_a.T, row_major)
        b, ldb = stored(op_b if tb == 111 else op_b.T, row_major)
        c, ldc = stored(c0, row_major)
        shim.cblas_sgemm(order, ta, tb, m, n, k, 1.5, a, lda, b, ldb, 0.5, c, ldc)
        out = c[:, :n] if row_major else c[:, :m].T
        np.testing.assert_allclose(out, 1.5 * op_a @ op_b + 0.5 * c0, rtol=1e-5, atol=1e-5,
                                   err_msg=str((order, ta, tb, m, n, k)))


def test_numpy_openblas_without_a_compiler_falls_back(tmp_path: Path) -> None:
    info, stderr, bound = _run_shim(tmp_path, PATH=str(tmp_path), CC="")
    assert info["active"].startswith("reference BLAS (MLX_INFER_BLAS=numpy unusable: cannot compile"), info
    assert "no C compiler" in stderr and len(stderr.strip().splitlines()) == 1, stderr
    assert all(_is_reference(library) for library in bound.values()), bound


def test_nothing_is_loaded_off_linux(monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    from mlx_infer import blas

    def refuse(*args, **kwargs):
        raise AssertionError("no library may be loaded off Linux")

    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(ctypes, "CDLL", refuse)
    monkeypatch.setenv("MLX_INFER_BLAS", "/some/libopenblas.so.0")
    assert blas._choose().startswith("the platform's own BLAS")
