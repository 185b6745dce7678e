"""Decode steps of two or more builds of the native CPU kernels, compared in one process.

    python benchmarks/ab_builds.py -m MODEL --builds A.so B.so [...] [-b 1,16] [-p 512] [--steps 200]
        [--switch 10] [--activations int16] [--json FILE]

On a shared VM whose speed drifts by tens of percent within minutes, two builds timed in two processes
differ by more than most kernel changes do. Here every build is loaded into the same process (a build's
folder in ``~/.cache/mlx-infer/cpu_kernels/<key>/`` holds its ``_cpu_kernels*.so``; edit the sources and
import ``mlx_infer.cpu_kernels`` to make one), one engine per batch size decodes after its prompts, and
the build its steps run on changes every ``--switch`` steps, so each build sees the same spells. Every
native op goes through ``mlx_infer.cpu_kernels._native``, which is what is switched. Each build is set
to the same activations (a build's own default is the package's, int16). Printed per batch size: each
build's median step and its ratio to the first build's.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# mlx_infer first: it binds the optimized BLAS, which only works before mlx.core is imported.
import mlx_infer  # noqa: E402,F401,I001
import numpy as np  # noqa: E402
import run_mlx_infer  # noqa: E402

from mlx_infer import cpu_kernels  # noqa: E402
from mlx_infer.cpu_kernels.build import MODULE_NAME  # noqa: E402
from mlx_infer.loading import load  # noqa: E402
from mlx_infer.sampling import SamplingParams  # noqa: E402

WARMUP_STEPS = 2  # of each switch: the steps right after a switch pay for the other build's cold caches


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    if not cpu_kernels.available():
        print(f"the native CPU kernels are unavailable: {cpu_kernels.unavailable_reason()}", file=sys.stderr)
        return 1
    builds = [_load_build(path, args.activations) for path in args.builds]
    lm = load(args.model)
    results = []
    for batch in args.b:
        medians = _compare(lm, builds, batch, args)
        results.append({"batch": batch, "median_step_s": medians, "ratio": [m / medians[0] for m in medians]})
        cells = "  ".join(f"[{i}] {m * 1e3:.2f} ms ({m / medians[0]:.3f})" for i, m in enumerate(medians))
        print(f"batch {batch}: {cells}")
    if args.json:
        data = {"builds": args.builds, "args": vars(args), "results": results}
        Path(args.json).write_text(json.dumps(data, indent=2))
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-m", "--model", required=True)
    parser.add_argument("--builds", nargs="+", required=True, help="_cpu_kernels*.so files, the base first")
    parser.add_argument("-b", type=lambda s: [int(x) for x in s.split(",")], default=[1, 16])
    parser.add_argument("-p", type=int, default=512, help="prompt tokens of each sequence")
    parser.add_argument("--steps", type=int, default=200, help="decode steps timed per batch size")
    parser.add_argument("--switch", type=int, default=10, help="steps on one build before the next")
    parser.add_argument(
        "--activations", default=cpu_kernels.DEFAULT_ACTIVATIONS, choices=cpu_kernels.ACTIVATIONS
    )
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if len(args.builds) < 2 or args.switch <= WARMUP_STEPS:
        parser.error(f"give two builds or more, and --switch above {WARMUP_STEPS}")
    return args


def _load_build(path: str, activations: str):
    spec = importlib.util.spec_from_file_location(MODULE_NAME, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"not a kernel build: {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.set_activations(activations)
    return module


def _compare(lm, builds: list, batch: int, args: argparse.Namespace) -> list[float]:
    package_build, cpu_kernels._native = cpu_kernels._native, builds[0]
    engine = run_mlx_infer._engine(lm, batch, args.p, args.steps + 8)
    rng = np.random.default_rng(0)
    for prompt in run_mlx_infer._prompts(rng, lm, batch, args.p):
        engine.add_request(prompt, SamplingParams(max_tokens=args.steps + 8, ignore_eos=True))
    started: set[str] = set()
    while len(started) < batch:  # the prefill, on the base build
        started |= {o.request_id for o in engine.step()}
    times: list[list[float]] = [[] for _ in builds]
    for i in range(args.steps):
        which = (i // args.switch) % len(builds)
        cpu_kernels._native = builds[which]
        start = time.perf_counter()
        engine.step()
        if i % args.switch >= WARMUP_STEPS:
            times[which].append(time.perf_counter() - start)
    cpu_kernels._native = package_build
    return [float(np.median(t)) for t in times]


if __name__ == "__main__":
    sys.exit(main())
