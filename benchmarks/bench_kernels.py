"""Metal kernels against their references and MLX's built-ins, printing time ratios.

    python benchmarks/bench_kernels.py [--batch 1,8,32] [--context 256,2048] [--calls 20]
    python benchmarks/bench_kernels.py --cpu-products 16,64,512 [--kinds int8,float32] [--rounds 5]

Paged attention (decode, Llama-8B-like heads: 32 query heads, 8 KV heads, head dim 128, float16):
the kernel vs the reference (gather by block table + SDPA) vs ``mx.fast.scaled_dot_product_attention``
on K/V that are already contiguous (the floor a paged kernel can hope to approach). Quantized matvec
(4096 x 4096, 4-bit, group 64, float16): the kernel vs the float32 reference vs ``mx.quantized_matmul``.
Where Metal is absent the Metal kernels cannot run: it says so and times the CPU paths instead, with
mlx-infer's native CPU kernels (``mlx_infer.cpu_kernels``, float32 inputs, which is what the CPU
backend computes in) where they are built.

``--cpu-products ROWS`` times only the native CPU kernels' quantized products of one SmolLM2-135M layer
(fused q/k/v 576->960, o_proj 576->576, fused gate/up 576->3072, down_proj 1536->576; 4-bit, groups of
32, as its Q4_1 GGUF loads) at each row count, for each activations kind (``--kinds``,
``cpu_kernels.ACTIVATIONS``), the kinds alternating within each of ``--rounds`` rounds so that a noisy
shared machine slows them alike: per kind, the median and the best round's median of a layer's four
products.
"""

from __future__ import annotations  # noqa: I001 (mlx_infer must be imported before mlx.core)

import argparse
import time
from collections.abc import Callable

# mlx_infer first: it binds the optimized BLAS (the float32 tiles' sgemm), which only works before
# mlx.core is imported.
import mlx_infer  # noqa: F401
import mlx.core as mx
import numpy as np

from mlx_infer import blas, cpu_kernels
from mlx_infer.interface.batch import SequenceSlice, build_metadata
from mlx_infer.metal_kernels import paged_attention, quantized, reference

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def best_ms(fn: Callable[[], mx.array], calls: int) -> float:
    mx.eval(fn())  # warm-up: compiles kernels, allocates buffers
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def attention_row(batch: int, context: int, calls: int, metal: bool) -> str:
    blocks = -(-context // BLOCK)
    perm = np.random.default_rng(0).permutation(batch * blocks)
    meta = build_metadata([SequenceSlice([int(b) for b in perm[i * blocks: (i + 1) * blocks]], context - 1, 1)
                           for i in range(batch)], BLOCK)
    pool = (batch * blocks * BLOCK, KV_HEADS, HEAD_DIM)
    keys, values = mx.random.normal(pool).astype(mx.float16), mx.random.normal(pool).astype(mx.float16)
    q = mx.random.normal((batch, HEADS, HEAD_DIM)).astype(mx.float16)
    k_dense = keys[meta.key_slots].transpose(0, 2, 1, 3)
    v_dense = values[meta.key_slots].transpose(0, 2, 1, 3)
    mx.eval(keys, values, q, k_dense, v_dense)
    scale = HEAD_DIM**-0.5
    ref = best_ms(lambda: reference.paged_attention(q, keys, values, meta, scale), calls)
    sdpa = best_ms(lambda: mx.fast.scaled_dot_product_attention(q[:, :, None], k_dense, v_dense, scale=scale),
                   calls)
    row = f"attention  batch {batch:3d} ctx {context:5d}: reference {ref:8.3f} ms"
    row += f"  sdpa(contiguous) {sdpa:8.3f} ms"
    if metal:
        kern = best_ms(lambda: paged_attention.paged_attention(q, keys, values, meta, scale), calls)
        row += f"  kernel {kern:8.3f} ms  ref/kernel {ref / kern:5.2f}x  kernel/sdpa {kern / sdpa:5.2f}x"
    elif cpu_kernels.available():
        q32, k32, v32 = (a.astype(mx.float32) for a in (q, keys, values))
        mx.eval(q32, k32, v32)
        kern = best_ms(lambda: cpu_kernels.paged_attention(q32, k32, v32, meta, scale), calls)
        row += f"  cpu kernel (f32) {kern:8.3f} ms  ref/cpu kernel {ref / kern:5.2f}x"
    return row


def matvec_row(rows: int, calls: int, metal: bool) -> str:
    w = mx.random.normal((4096, 4096))
    wq, scales, biases = mx.quantize(w, group_size=64, bits=4)
    scales, biases = scales.astype(mx.float16), biases.astype(mx.float16)
    x = mx.random.normal((rows, 4096)).astype(mx.float16)
    mx.eval(wq, scales, biases, x)
    ref = best_ms(lambda: reference.quantized_matmul(x, wq, scales, biases, 64, 4), calls)
    builtin = best_ms(lambda: mx.quantized_matmul(x, wq, scales, biases, group_size=64, bits=4), calls)
    row = f"q4 matvec  rows {rows:3d}: reference {ref:8.3f} ms  mx.quantized_matmul {builtin:8.3f} ms"
    if metal:
        kern = best_ms(lambda: quantized.affine_matvec(x, wq, scales, biases, 64, 4), calls)
        row += f"  kernel {kern:8.3f} ms  builtin/kernel {builtin / kern:5.2f}x"
    elif cpu_kernels.available():
        x32, s32, b32 = (a.astype(mx.float32) for a in (x, scales, biases))
        mx.eval(x32, s32, b32)
        kern = best_ms(lambda: cpu_kernels.quantized_matmul(x32, wq, s32, b32, 64, 4), calls)
        row += f"  cpu kernel (f32) {kern:8.3f} ms  builtin/cpu kernel {builtin / kern:5.2f}x"
    return row


# (name, K, N) of one SmolLM2-135M layer's products, with q/k/v and gate/up fused as the runner fuses them.
SMOLLM2_LAYER = (("qkv", 576, 960), ("o_proj", 576, 576), ("gate_up", 576, 3072), ("down_proj", 1536, 576))


def cpu_products_row(rows: int, kinds: list[str], calls: int, rounds: int) -> str:
    rng = np.random.default_rng(rows)
    layer = []
    for _, k, n in SMOLLM2_LAYER:
        w, scales, biases = mx.quantize(mx.array(rng.standard_normal((n, k)).astype(np.float32)), 32, 4)
        x = mx.array(rng.standard_normal((rows, k)).astype(np.float32))
        mx.eval(w, scales, biases, x)
        layer.append((x, w, scales, biases))

    def products() -> list[mx.array]:
        return [cpu_kernels.quantized_matmul(x, w, s, b, 32, 4) for x, w, s, b in layer]

    medians: dict[str, list[float]] = {kind: [] for kind in kinds}
    for _ in range(rounds):
        for kind in kinds:
            cpu_kernels.set_activations(kind)
            mx.eval(products())  # warm-up
            times = []
            for _ in range(calls):
                start = time.perf_counter()
                mx.eval(products())
                times.append(time.perf_counter() - start)
            medians[kind].append(float(np.median(times)) * 1e3)
    cells = [f"{kind} {np.median(m):7.3f} (best {min(m):7.3f})" for kind, m in medians.items()]
    return f"SmolLM2 layer products, rows {rows:4d}, ms: " + "  ".join(cells)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--context", default="256,2048")
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--cpu-products", default=None, metavar="ROWS",
                        help="only time SmolLM2's layer products on the native CPU kernels, at these rows")
    parser.add_argument("--kinds", default="int8,float32", help="activations kinds for --cpu-products")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds for --cpu-products")
    args = parser.parse_args()
    if args.cpu_products:
        if not cpu_kernels.available():
            parser.error(f"native CPU kernels unavailable: {cpu_kernels.unavailable_reason()}")
        kinds = args.kinds.split(",")
        print(f"BLAS: {blas.active()}; int8 kernel: {cpu_kernels.activations()}", flush=True)
        if unknown := [k for k in kinds if k not in cpu_kernels.ACTIVATIONS]:
            parser.error(f"--kinds: {', '.join(unknown)} not among {', '.join(cpu_kernels.ACTIVATIONS)}")
        for rows in (int(r) for r in args.cpu_products.split(",")):
            print(cpu_products_row(rows, kinds, args.calls, args.rounds), flush=True)
        return
    metal = mx.metal.is_available()
    if not metal:
        print("Metal is not available on this machine: the Metal kernels cannot run here, so the reference, "
              "MLX built-in and native CPU kernel paths are timed (on the CPU). Run this on Apple silicon "
              "for Metal kernel numbers.")
    for batch in (int(b) for b in args.batch.split(",")):
        for context in (int(c) for c in args.context.split(",")):
            print(attention_row(batch, context, args.calls, metal), flush=True)
    for rows in (1, 4, 16):
        print(matvec_row(rows, args.calls, metal), flush=True)


if __name__ == "__main__":
    main()
