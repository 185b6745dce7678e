"""float32 matmul time through MLX with each BLAS: the reference one and what mlx_infer binds.

    python benchmarks/bench_blas.py [--blas off,auto,/path/libopenblas.so.0]

Each setting runs in its own interpreter (the BLAS is bound once, before ``mlx.core`` is imported).
Shapes are SmolLM2's MLP up-projection (576 -> 1536): one row (a decode step) and 64 rows (a batch).
Times are the minimum over many calls, the figure least disturbed by other load on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = """
import json, sys, time
import mlx_infer
from mlx_infer import blas
import mlx.core as mx

def best_us(rows, calls):
    x = mx.random.normal((rows, 576)); w = mx.random.normal((1536, 576)); mx.eval(x, w)
    times = []
    for _ in range(calls):
        start = time.perf_counter(); mx.eval(x @ w.T); times.append(time.perf_counter() - start)
    return min(times[3:]) * 1e6

print(json.dumps({"blas": blas.active(), "matvec_us": best_us(1, 300), "matmul64_us": best_us(64, 40)}))
"""


def measure(setting: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "MLX_INFER_BLAS"}
    if setting != "auto":
        env["MLX_INFER_BLAS"] = setting
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blas", default="off,auto", help="MLX_INFER_BLAS settings; auto = unset")
    args = parser.parse_args()
    print(f"{'MLX_INFER_BLAS':16} {'matvec 1x576->1536':>20} {'64x576->1536':>14}  BLAS in use")
    for setting in args.blas.split(","):
        r = measure(setting)
        print(f"{setting:16} {r['matvec_us']:17.0f} µs {r['matmul64_us']:11.0f} µs  {r['blas']}")


if __name__ == "__main__":
    main()
