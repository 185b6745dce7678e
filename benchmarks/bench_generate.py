"""Prefill and decode tokens/s of mlx-infer, llama-bench style, with the peers on the same weights.

    python benchmarks/bench_generate.py -m MODEL [-p 512] [-n 128] [-r 3] [-b 1,4,16]
        [--compare mlx-lm,llama.cpp] [--llama-bench PATH] [--json FILE] [--profile]
    python benchmarks/bench_generate.py -m MODEL --speculative ngram|draft [-n 128] [-r 3] [-b 1,16]
        [--draft-model PATH] [--num-draft-tokens K] [--speculative-max-batch N]

With ``--speculative``, plain and speculative greedy decoding are compared instead, on a code-editing
and a summarisation prompt (run_speculative.py): decode tok/s, acceptance, and whether the texts agree.

Each decode figure is printed next to its bound: the machine's single-threaded memory read bandwidth
divided by the bytes a decode step reads (weights + KV cache), times the batch size. The bandwidth is
measured again right before each repetition of each engine and setting, and each repetition is set
against its own bound (a shared VM's speed drifts by tens of percent within minutes). See README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# mlx_infer first: it binds the optimized BLAS, which only works before mlx.core is imported.
import mlx_infer  # noqa: E402,F401,I001
import hardware  # noqa: E402
import peers  # noqa: E402
import run_mlx_infer  # noqa: E402
import run_speculative  # noqa: E402
from measure import Result, mean, std  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from mlx_infer import blas, cpu_kernels  # noqa: E402
from mlx_infer.engine.speculative import METHODS, SpeculativeConfig  # noqa: E402
from mlx_infer.loading import load  # noqa: E402
from mlx_infer.plan.planner import KV_CACHE_DTYPES  # noqa: E402

PEERS = ("mlx-lm", "llama.cpp")


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Piped output (CI logs, tee) would otherwise be cut to 80 columns and wrap every row.
    console = Console(width=None if sys.stdout.isatty() else 150)
    logging.basicConfig(level=logging.WARNING)
    console.print(f"BLAS: {blas.active()}")
    probe = hardware.BandwidthProbe()
    bandwidth = probe()
    console.print(f"memory read bandwidth (1 thread): {bandwidth / 1e9:.1f} GB/s")

    lm = load(args.model, keep_quantized=args.keep_quantized)
    if lm.weight_policy:
        console.print(lm.weight_policy)
    if args.speculative:
        spec = SpeculativeConfig(args.speculative, args.num_draft_tokens, args.speculative_max_batch)
        draft = None
        if args.speculative == "draft":
            if args.draft_model is None:
                raise SystemExit("--speculative draft needs --draft-model")
            draft = load(args.draft_model, keep_quantized=args.keep_quantized).model
        spec_results = run_speculative.run(lm, spec, args.n, args.r, args.b, draft)
        _print_speculative(console, spec_results, spec)
        if args.json:
            rows = [{**vars(r), "acceptance": r.acceptance} for r in spec_results]
            Path(args.json).write_text(json.dumps({"speculative": rows}, indent=2))
        return 0 if all(r.identical for r in spec_results) else 1
    # Rounds, not repetitions back to back: each round runs every engine and setting once, so that on a
    # machine whose speed drifts by tens of percent within minutes (shared VMs) the engines compared see
    # the same spells and their ratios hold; each row's samples are its rounds'.
    rows: dict[tuple, Result] = {}  # (engine, weights, KV, batch) -> its samples so far
    skipped: dict[tuple[str, str], str] = {}  # (peer, KV type) -> why it was not run
    for _ in range(args.r):
        _add_samples(rows, run_mlx_infer.run(
            lm, args.p, args.n, 1, args.b, kv_dtypes=args.kv_cache_dtype, activations=args.cpu_activations,
            bandwidth=probe,
        ))
        for peer in args.compare:
            for kv_dtype in args.kv_cache_dtype if peer == "llama.cpp" else ["auto"]:
                if (peer, kv_dtype) in skipped:
                    continue
                try:
                    before = probe()
                    result, why = _run_peer(peer, lm, args, kv_dtype)
                    if result is not None:
                        result.bandwidth = [before] * len(result.decode)
                except (RuntimeError, OSError, subprocess.SubprocessError) as e:
                    # A broken peer must not cost the figures already measured.
                    result, why = None, f"failed: {e}"
                if result is not None:
                    _add_samples(rows, [result])
                else:
                    skipped[peer, kv_dtype] = f"{peer}: {why}"
    results = list(rows.values())
    profiles = [run_mlx_infer.profile_ops(lm, b, args.p) for b in args.b] if args.profile else []

    _print_table(console, results, bandwidth)
    _print_bandwidths(console, results)
    _print_ratios(console, results)
    skipped_lines = list(dict.fromkeys(skipped.values()))
    for line in skipped_lines:
        console.print(f"[yellow]skipped {line}[/yellow]")
    for prof in profiles:
        top = ", ".join(f"{name} {count}" for name, count in list(prof.by_op.items())[:8])
        console.print(
            f"profile: batch {prof.batch}: {prof.ops_per_step} MLX ops per decode step "
            f"({prof.ops_per_token:.0f} per generated token); most frequent: {top}"
        )
    if args.json:
        _write_json(Path(args.json), args, results, profiles, bandwidth, skipped_lines)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", required=True, help="GGUF file, HF/MLX folder or Hub repo id")
    parser.add_argument("-p", type=int, default=512, help="prompt tokens (default 512)")
    parser.add_argument("-n", type=int, default=128, help="generated tokens (default 128)")
    parser.add_argument("-r", type=int, default=3,
                        help="repetitions (default 3), as rounds: each runs every engine and setting once")
    parser.add_argument("-b", type=_int_list, default=[1, 4, 16], help="batch sizes (default 1,4,16)")
    parser.add_argument("--compare", type=_peer_list, default=[], help="peers: mlx-lm,llama.cpp")
    parser.add_argument("--llama-bench", help="path of llama-bench (default: on PATH)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--keep-quantized", action="store_const", const=True, default=None,
                         help="keep quantized weights quantized even without a fast kernel for them")
    weights.add_argument("--dequantize", action="store_const", const=False, dest="keep_quantized",
                         help="dequantize weights at load (float32 through the BLAS on the CPU backend)")
    parser.add_argument("--kv-cache-dtype", type=_kv_list, default=["auto"],
                        help="KV cache dtypes to run, e.g. float16,int8 (default auto); llama.cpp runs the "
                        "same (-ctk/-ctv f16, bf16, q8_0 for int8; it has no float32 cache)")
    parser.add_argument("--cpu-activations", type=_activations_list, default=[None],
                        help="CPU activation kinds to run, e.g. int16,int8 (default: the process's, "
                        f"${cpu_kernels.ACTIVATIONS_ENV_VAR} or {cpu_kernels.DEFAULT_ACTIVATIONS})")
    parser.add_argument("--json", help="also write the results to this file")
    spec = SpeculativeConfig()
    parser.add_argument("--speculative", choices=METHODS, default=None,
                        help="compare plain and speculative decoding on a code edit and a summary instead")
    parser.add_argument("--draft-model", help="with --speculative draft: the draft model")
    parser.add_argument("--num-draft-tokens", type=int, default=spec.num_draft_tokens,
                        help=f"most tokens proposed per step (default {spec.num_draft_tokens})")
    parser.add_argument("--speculative-max-batch", type=int, default=spec.max_batch,
                        help=f"speculate up to this batch size (default {spec.max_batch})")
    parser.add_argument("--profile", action="store_true", help="count MLX ops per decode step")
    args = parser.parse_args(argv)
    if min(args.p, args.n, args.r, *args.b) < 1:
        parser.error("-p, -n, -r and -b must be at least 1")
    return args


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _kv_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in KV_CACHE_DTYPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"KV cache dtypes are {', '.join(KV_CACHE_DTYPES)}")
    return names


def _activations_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in cpu_kernels.ACTIVATIONS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"CPU activations are {', '.join(cpu_kernels.ACTIVATIONS)}")
    return names


def _peer_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    return names


def _add_samples(rows: dict[tuple, Result], new: list[Result]) -> None:
    """``new``'s samples into the row of the same engine, weights, KV type and batch (a new row if none)."""
    for r in new:
        row = rows.setdefault((r.engine, r.weights, r.kv, r.batch), r)
        if row is not r:
            row.prefill += r.prefill
            row.decode += r.decode
            row.bandwidth += r.bandwidth


def _run_peer(peer: str, lm, args: argparse.Namespace, kv_dtype: str) -> tuple[Result | None, str]:
    """One round of the peer at batch 1 (llama.cpp: with ``kv_dtype``'s cache type), or None and why it
    was not run."""
    import mlx.core as mx

    from mlx_infer.engine.runner import kv_bytes_per_token

    if peer == "mlx-lm":
        if not peers.mlx_lm_installed():
            return None, "not installed (pip install mlx-lm)"
        folder = peers.export_mlx_checkpoint(lm, lm.source)
        kv = kv_bytes_per_token(lm.model, mx.bfloat16)
        return peers.run_mlx_lm(folder, args.p, args.n, 1, kv), ""
    binary = peers.find_llama_bench(args.llama_bench)
    if binary is None:
        return None, "llama-bench not found (put it on PATH or pass --llama-bench PATH)"
    if not lm.source.endswith(".gguf"):
        return None, "llama.cpp needs a .gguf model"
    if kv_dtype not in peers.LLAMA_KV_TYPES:
        return None, f"llama-bench has no {kv_dtype} KV cache"
    return peers.run_llama_bench(binary, lm.source, args.p, args.n, 1, args.threads, kv_dtype), ""


def _print_speculative(console: Console, results: list, spec: SpeculativeConfig) -> None:
    table = Table(
        title=f"greedy decode tok/s, plain vs --speculative {spec.method} (K={spec.num_draft_tokens}, "
        f"max batch {spec.max_batch}); runs alternate"
    )
    for name in ("task", "batch", "tokens", "plain tok/s", "speculative tok/s", "speedup", "acceptance",
                 "same text"):
        table.add_column(name, justify="left" if name == "task" else "right")
    for r in results:
        table.add_row(
            r.task, str(r.batch), str(r.tokens), _fmt(r.plain), _fmt(r.speculative),
            f"{mean(r.speculative) / mean(r.plain):.2f}x", f"{r.acceptance:.0%} ({r.accepted}/{r.proposed})",
            "yes" if r.identical else "NO",
        )
    console.print(table)


def _print_table(console: Console, results: list[Result], bandwidth: float) -> None:
    table = Table(title="generate: prefill and decode tokens/s (mean ± std over repetitions)")
    columns = ("engine", "weights", "KV", "batch", "prefill tok/s", "decode tok/s", "decode bound",
               "of bound")
    for name in columns:
        table.add_column(name, justify="left" if name in ("engine", "weights", "KV") else "right")
    for r in results:
        bound, share = _bound(r, bandwidth), _share(r, bandwidth)
        table.add_row(
            r.engine, r.weights, r.kv or "-", str(r.batch), _fmt(r.prefill), _fmt(r.decode), f"{bound:.1f}",
            f"{share:.0%}",
        )
    console.print(table)
    console.print(
        "decode bound = batch × bandwidth ÷ (weight bytes + batch × KV bytes at the mean context) per step, "
        "the bandwidth measured right before each repetition; of bound = the mean of each repetition's "
        "decode ÷ its own bound"
    )


def _print_bandwidths(console: Console, results: list[Result]) -> None:
    measured = [bw for r in results for bw in r.bandwidth]
    if measured:
        console.print(
            f"memory read bandwidth before the {len(measured)} repetitions: {min(measured) / 1e9:.1f} to "
            f"{max(measured) / 1e9:.1f} GB/s (mean {mean(measured) / 1e9:.1f})"
        )


# The KV cache of ours that llama.cpp's equals (its q8_0: our int8, with a scale per 32 values, ours per row).
SAME_KV = {"f16": "float16", "f32": "float32", "bf16": "bfloat16", "q8_0": "int8"}


def _print_ratios(console: Console, results: list[Result]) -> None:
    ours = [r for r in results if r.engine == "mlx-infer"]
    for peer in (r for r in results if r.engine != "mlx-infer"):
        # llama.cpp against the same KV type; mlx-lm (its own bfloat16 cache) against our first one;
        # each of our activation kinds (the weights column) in turn
        same = [r for r in ours if r.batch == peer.batch and r.kv == SAME_KV.get(peer.kv, "")]
        for mine in same or [r for r in ours if r.batch == peer.batch][:1]:
            console.print(
                f"mlx-infer ({mine.weights}) / {peer.engine} ({peer.weights}, KV {peer.kv}) at batch "
                f"{peer.batch}: prefill {mean(mine.prefill) / mean(peer.prefill):.2f}×, "
                f"decode {mean(mine.decode) / mean(peer.decode):.2f}×"
            )


def _bound_at(r: Result, bandwidth: float) -> float:
    return hardware.decode_bound(bandwidth, r.weight_bytes, r.kv_bytes_per_token, r.batch, r.decode_context)


def _bounds(r: Result, bandwidth: float) -> list[float]:
    """Each decode repetition's bound, from the bandwidth measured right before it (else ``bandwidth``)."""
    measured = r.bandwidth if len(r.bandwidth) == len(r.decode) else [bandwidth] * len(r.decode)
    return [_bound_at(r, bw) for bw in measured]


def _bound(r: Result, bandwidth: float) -> float:
    """The mean of the repetitions' bounds (the bound at ``bandwidth`` when none was decoded)."""
    bounds = _bounds(r, bandwidth)
    return mean(bounds) if bounds else _bound_at(r, bandwidth)


def _share(r: Result, bandwidth: float) -> float:
    """The mean over the repetitions of decode tok/s ÷ that repetition's bound."""
    shares = [d / b for d, b in zip(r.decode, _bounds(r, bandwidth), strict=True)]
    return mean(shares) if shares else math.nan


def _fmt(values: list[float]) -> str:
    return f"{mean(values):.1f} ± {std(values):.1f}" if values else "-"


def _write_json(path: Path, args, results, profiles, bandwidth: float, skipped: list[str]) -> None:
    data = {
        "machine": {
            "platform": platform.platform(), "cpus": os.cpu_count(), "blas": blas.active(),
            "read_bandwidth_bytes_per_s": bandwidth,
        },
        "args": {"model": args.model, "p": args.p, "n": args.n, "r": args.r, "b": args.b,
                 "compare": args.compare, "keep_quantized": args.keep_quantized,
                 "kv_cache_dtype": args.kv_cache_dtype},
        "results": [
            dict(r.to_json(), decode_bound=_bound(r, bandwidth), of_bound=_share(r, bandwidth))
            for r in results
        ],
        "profile": [
            {"batch": p.batch, "ops_per_step": p.ops_per_step, "ops_per_token": p.ops_per_token,
             "by_op": p.by_op}
            for p in profiles
        ],
        "skipped": skipped,
    }
    path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    sys.exit(main())
