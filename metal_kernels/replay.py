"""Export each kernel's traced graph with inputs and expected outputs; replay them on a Mac.

On Linux (no Metal) ``export`` still works: tracing builds the graph without running it. A
contributor with Apple silicon then runs ``replay`` and sees, per case, the largest error against
the float32 reference computed here::

    python -m mlx_infer.metal_kernels.replay export /tmp/kernel-cases     # anywhere
    python -m mlx_infer.metal_kernels.replay run /tmp/kernel-cases        # on a Mac
    python -m mlx_infer.metal_kernels.replay run --emulate                # same cases, CPU emulator
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import mlx.core as mx
import numpy as np

from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.metal_kernels import gguf_reference, paged_attention, quantized, reference
from mlx_infer.metal_kernels.launch import Launcher, metal_launch

TOLERANCE = {"float32": 1e-4, "float16": 5e-3, "bfloat16": 4e-2}  # on outputs of unit scale
Case = tuple[Callable[..., mx.array], list[mx.array], mx.array]  # kernel function, its inputs, expected


def _attention_case(contexts: list[int], queries_per_seq: list[int], n_heads: int, n_kv: int, head_dim: int,
                    dtype: mx.Dtype, partition_keys: int | None = None) -> Case:
    rng = np.random.default_rng(0)
    blocks = [-(-c // 16) for c in contexts]
    perm = rng.permutation(sum(blocks) + 2)
    starts = np.cumsum([0, *blocks])
    meta = build_metadata([SequenceSlice([int(b) for b in perm[s: s + n]], c - q, q)
                           for s, n, c, q in zip(starts, blocks, contexts, queries_per_seq)], 16)
    pool = (len(perm) * 16, n_kv, head_dim)
    keys, values = (mx.array(rng.standard_normal(pool).astype(np.float32)).astype(dtype) for _ in range(2))
    q_shape = (sum(queries_per_seq), n_heads, head_dim)
    q = mx.array(rng.standard_normal(q_shape).astype(np.float32)).astype(dtype)
    scale = head_dim**-0.5

    def run(q: mx.array, k: mx.array, v: mx.array, launch: Launcher = metal_launch) -> mx.array:
        return paged_attention.paged_attention(q, k, v, meta, scale, partition_keys=partition_keys,
                                               launch=launch)

    f32 = [a.astype(mx.float32) for a in (q, keys, values)]
    return run, [q, keys, values], reference.paged_attention(*f32, meta, scale)


def _affine_case(bits: int, group: int, dtype: mx.Dtype) -> Case:
    rng = np.random.default_rng(1)
    weight = mx.array(rng.standard_normal((512, 1024)).astype(np.float32))
    wq, scales, biases = mx.quantize(weight, group, bits)
    x = mx.array(rng.standard_normal((2, 1024)).astype(np.float32) / 32).astype(dtype)
    bias = mx.array(rng.standard_normal((512,)).astype(np.float32)).astype(dtype)
    scales, biases = scales.astype(dtype), biases.astype(dtype)

    def run(x: mx.array, wq: mx.array, scales: mx.array, biases: mx.array, bias: mx.array,
            launch: Launcher = metal_launch) -> mx.array:
        return quantized.affine_matvec(x, wq, scales, biases, group, bits, bias, launch=launch)

    f32 = [a.astype(mx.float32) for a in (x, scales, biases, bias)]
    expected = reference.quantized_matmul(f32[0], wq, f32[1], f32[2], group, bits, f32[3])
    return run, [x, wq, scales, biases, bias], expected


def _kquant_case(kind: str) -> Case:
    rng = np.random.default_rng(2)
    size = gguf_reference.BLOCK_BYTES[kind]
    raw = rng.integers(0, 256, (256, 4, size), dtype=np.uint8)
    # Sane float16 super-block scales (random bytes there would be inf or NaN): d, dmin for Q4_K/Q5_K.
    halves = rng.uniform(1e-3, 2e-2, (256, 4, 2)).astype(np.float16).view(np.uint8)
    if kind in ("Q4_K", "Q5_K"):
        raw[..., 0:4] = halves
    else:
        raw[..., 208:210] = halves[..., :2]
    w = mx.array(raw.reshape(256, -1))
    x = mx.array(rng.standard_normal((1, 1024)).astype(np.float32) / 32)

    def run(x: mx.array, w: mx.array, launch: Launcher = metal_launch) -> mx.array:
        return quantized.kquant_matvec(x, w, kind, launch=launch)

    return run, [x, w], gguf_reference.gguf_matmul(x, w, kind)


def cases() -> dict[str, Callable[[], Case]]:
    out: dict[str, Callable[[], Case]] = {}
    for dtype in (mx.float32, mx.float16, mx.bfloat16):
        name = str(dtype).split(".")[-1]
        out[f"decode_{name}"] = lambda d=dtype: _attention_case([1, 15, 16, 17, 300], [1] * 5, 8, 2, 128, d)
        out[f"split_kv_{name}"] = lambda d=dtype: _attention_case([900, 40], [1, 1], 4, 1, 64, d, 256)
        out[f"prefill_{name}"] = lambda d=dtype: _attention_case([70, 33], [30, 33], 6, 2, 96, d)
    for bits in (4, 8):
        for group in (32, 64, 128):
            out[f"affine_{bits}bit_g{group}"] = lambda b=bits, g=group: _affine_case(b, g, mx.float16)
    out["q4_k"] = lambda: _kquant_case("Q4_K")
    out["q5_k"] = lambda: _kquant_case("Q5_K")
    out["q6_k"] = lambda: _kquant_case("Q6_K")
    return out


def export(folder: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, make in cases().items():
        run, inputs, expected = make()
        mx.eval(inputs, expected)
        mx.export_function(str(folder / f"{name}.mlxfn"), run, *inputs)
        arrays = {f"input_{i}": a for i, a in enumerate(inputs)} | {"expected": expected}
        mx.save_safetensors(str(folder / f"{name}.safetensors"), arrays,
                            metadata={"dtype": _dtype_name(inputs[0])})
        print(f"exported {name}")


def _dtype_name(activations: mx.array) -> str:
    """The kernel's output dtype (that of its activations), which sets the tolerance."""
    return str(activations.dtype).split(".")[-1]


def _check(name: str, out: mx.array, expected: mx.array, dtype: str) -> bool:
    expected = expected.astype(mx.float32)
    error = float(mx.abs(out.astype(mx.float32) - expected).max())
    bound = TOLERANCE[dtype] * max(1.0, float(mx.abs(expected).max()))
    print(f"{'ok  ' if error <= bound else 'FAIL'} {name:24s} max error {error:.3g} (bound {bound:.3g})")
    return error <= bound


def replay(folder: Path) -> int:
    """Run the exported graphs on Metal and compare with the stored expected outputs."""
    if not mx.metal.is_available():
        print("Metal is not available on this machine: replay needs Apple silicon (export works anywhere; "
              "`run --emulate` checks the same cases on the CPU).")
        return 2
    ok = True
    for graph in sorted(folder.glob("*.mlxfn")):
        arrays, meta = mx.load(str(graph.with_suffix(".safetensors")), return_metadata=True)
        inputs = [arrays[f"input_{i}"] for i in range(len(arrays) - 1)]
        (out,) = mx.import_function(str(graph))(*inputs)
        ok &= _check(graph.stem, out, arrays["expected"], meta["dtype"])
    return 0 if ok else 1


def emulate() -> int:
    """The same cases through the Metal emulator (no export): proves the expectations hold here."""
    from mlx_infer.metal_kernels.emulator import Emulator

    launch = Emulator().launch
    ok = True
    for name, make in cases().items():
        run, inputs, expected = make()
        ok &= _check(name, run(*inputs, launch=launch), expected, _dtype_name(inputs[0]))
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mlx_infer.metal_kernels.replay", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=["export", "run"])
    parser.add_argument("folder", type=Path, nargs="?", help="where the cases are (not with --emulate)")
    parser.add_argument("--emulate", action="store_true", help="run: use the CPU emulator instead of Metal")
    args = parser.parse_args(argv)
    if args.command == "run" and args.emulate:
        return emulate()
    if args.folder is None:
        parser.error("a folder is required")
    if args.command == "export":
        export(args.folder)
        return 0
    return replay(args.folder)


if __name__ == "__main__":
    sys.exit(main())
