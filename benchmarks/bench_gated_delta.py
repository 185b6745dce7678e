"""The Gated DeltaNet recurrence over prefill chunks on the CPU: the native sequential kernel against the
chunked MLX form (the reference, and what runs where the kernel is not built).

    python benchmarks/bench_gated_delta.py [--lengths 16,64,256,512] [--batch 1] [--rounds 5]

Times ``sequences_step`` (the path a prefill chunk takes: decay prep, the recurrence, the state written
back into its slot) for one chunk of each length per sequence, continuing from a nonzero state, at
Qwen3.5-like heads (16 key heads, 32 value heads, 128 x 128 state matrices) and at the tiny test
checkpoints' (2 key heads, 4 value heads, 16 x 8). The two paths alternate within each round so that a
noisy shared machine slows them alike; the median over rounds is reported, in ms per layer call.
"""

from __future__ import annotations  # noqa: I001 (mlx_infer must be imported before mlx.core)

import argparse
import statistics
import time

# mlx_infer first: it binds the optimized BLAS, which only works before mlx.core is imported.
import mlx_infer  # noqa: F401
import mlx.core as mx

from mlx_infer import cpu_kernels
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.interface.state import LayerState, StateSpec
from mlx_infer.models.gated_delta import Ragged, prepare_qk, sequences_step

# (name, key heads, value heads, Dk, Dv)
SHAPES = [("qwen3.5", 16, 32, 128, 128), ("tiny", 2, 4, 16, 8)]
NATIVE = cpu_kernels.gated_delta


def case(batch: int, length: int, hk: int, hv: int, dk: int, dv: int):
    key = mx.random.key(0)
    ks = mx.random.split(key, 6)
    q, k = prepare_qk(mx.random.normal((batch, length, hk, dk), key=ks[0]),
                      mx.random.normal((batch, length, hk, dk), key=ks[1]), hv)
    v = mx.random.normal((batch, length, hv, dv), key=ks[2])
    g = -mx.abs(mx.random.normal((batch, length, hv), key=ks[3])) * 0.3
    beta = mx.sigmoid(mx.random.normal((batch, length, hv), key=ks[4]))
    state = LayerState(batch, StateSpec(((hv, dk + 1, dv),)))
    state.arrays[0] = mx.random.normal(state.arrays[0].shape, key=ks[5])
    slices = [SequenceSlice(list(range(length * 2)), length, length) for _ in range(batch)]
    meta = build_metadata(slices, 16)
    mx.eval(q, k, v, g, beta, state.arrays[0])
    return q, k, v, g, beta, state, meta


def call_ms(native: bool, inputs) -> float:
    q, k, v, g, beta, state, meta = inputs
    # Without the native kernel sequences_step takes the chunked form (as where it is not built).
    cpu_kernels.gated_delta = NATIVE if native else (lambda *args: None)
    keep = mx.ones((q.shape[0],))
    start = time.perf_counter()
    out = sequences_step(q, k, v, g, beta, state, 0, meta.state_slots, keep, Ragged.of(meta))
    mx.eval(out, state.arrays[0])
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="16,64,256,512")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    if not cpu_kernels.available():
        raise SystemExit(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
    print("| heads | tokens | native ms | chunked ms | chunked / native |")
    print("|---|---|---|---|---|")
    for name, hk, hv, dk, dv in SHAPES:
        for length in (int(x) for x in args.lengths.split(",")):
            inputs = case(args.batch, length, hk, hv, dk, dv)
            call_ms(True, inputs), call_ms(False, inputs)  # warm-up
            native, chunked = [], []
            for _ in range(args.rounds):
                native.append(call_ms(True, inputs))
                chunked.append(call_ms(False, inputs))
            n, c = statistics.median(native), statistics.median(chunked)
            print(f"| {name} | {length} | {n:.2f} | {c:.2f} | {c / n:.2f} |", flush=True)


if __name__ == "__main__":
    main()
