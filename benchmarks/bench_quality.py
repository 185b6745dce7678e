"""What each lossy runtime option costs in accuracy, against the exact path, in decode mode.

    python benchmarks/bench_quality.py -m MODEL [--text FILE] [--tokens 400] [--chunk C]
        [--compare llama.cpp] [--llama-dir DIR] [--json FILE]

The text's tokens are fed one a step (teacher-forced) through the engine's runner and paged KV cache,
as generation runs them, once on the exact path (float32 activations) and once per lossy option, in
lockstep. Per predicted position: KL(exact || option), whether the argmax tokens agree, and each path's
negative log-likelihood of the actual next token (perplexity). By default the first ``--tokens`` tokens
are one sequence and every position is scored; ``--chunk C`` scores as ``llama-perplexity -c C`` does:
chunks of C tokens, each from an empty cache, only the second half of each scored, until about
``--tokens`` positions are.
The lossy options are the activation kinds of the native CPU kernels and the KV cache dtypes
(``--kv-cache-dtype float16|bfloat16|int8``), each alone, and the defaults together.
``--compare llama.cpp`` runs ``llama-perplexity --kl-divergence`` of the same GGUF against an F32 GGUF
of its weights on the same text, llama.cpp's own measure of its 8-bit activations, and of the F32 GGUF
with ``-ctk q8_0 -ctv q8_0``, its 8-bit KV cache alone. See README.md.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# mlx_infer first: it binds the optimized BLAS, which only works before mlx.core is imported.
import mlx_infer  # noqa: E402,F401,I001
import peers  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from teacher_forced import DecodePath  # noqa: E402

import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402

from mlx_infer import blas, cpu_kernels  # noqa: E402
from mlx_infer.convert.evaluate import DEFAULT_EVAL_FILE, Quality, eval_windows  # noqa: E402
from mlx_infer.errors import InvalidRequest, MlxInferError  # noqa: E402
from mlx_infer.loading import load  # noqa: E402

PEERS = ("llama.cpp",)
LLAMA_CTX = 256  # llama-perplexity's -c without --chunk


@dataclass(frozen=True)
class Option:
    """One runtime setting the engine offers; the exact path is every field at its default.

    A new lossy option (a KV cache dtype, speculative decoding) is a field here, applied in
    :func:`applied`, and one entry in :data:`OPTIONS`.
    """

    name: str
    activations: str = "float32"  # cpu_kernels.set_activations kind of the decode matvecs
    kv_cache_dtype: str = "float32"  # --kv-cache-dtype of the path's KV pool


EXACT = Option("exact (float32 activations and KV)")
OPTIONS = (
    Option("int16 activations (default --cpu-activations)", activations="int16"),
    Option("int8 activations (--cpu-activations int8)", activations="int8"),
    Option("int8 activations, AVX2 kernel", activations="int8-avx2"),
    Option("float16 KV (default --kv-cache-dtype on CPU)", kv_cache_dtype="float16"),
    Option("bfloat16 KV (--kv-cache-dtype bfloat16)", kv_cache_dtype="bfloat16"),
    Option("int8 KV (--kv-cache-dtype int8)", kv_cache_dtype="int8"),
    Option("defaults: int16 activations, float16 KV", activations="int16", kv_cache_dtype="float16"),
)


@contextmanager
def applied(option: Option):
    """``option``'s settings for the products evaluated inside; the exact path's again after."""
    cpu_kernels.set_activations(option.activations)
    try:
        yield
    finally:
        cpu_kernels.set_activations(EXACT.activations)


def runnable(options: tuple[Option, ...]) -> list[Option]:
    """The options that would compute differently from the exact path and from each other here: the
    int8 kernel picked at run time may be the AVX2 one already, and without the native kernels there
    are no int8 activations at all."""

    def effect(option: Option) -> Option:
        with applied(option):
            return replace(option, name="", activations=cpu_kernels.activations())

    seen, out = {effect(EXACT)}, []
    for option in options:
        key = effect(option)
        if key not in seen:
            seen.add(key)
            out.append(option)
    return out


@dataclass
class _Rows:
    """Per-position figures of one option, as host arrays once a window is done."""

    kl: list[np.ndarray]
    same: list[np.ndarray]
    nll: list[np.ndarray]

    def quality(self, nll_exact: list[np.ndarray], windows: int) -> Quality:
        kl = np.concatenate(self.kl).astype(np.float64)
        return Quality(
            tokens=int(kl.size), windows=windows, kl_mean=float(kl.mean()),
            kl_p99=float(np.percentile(kl, 99)), kl_max=float(kl.max()),
            top1_agreement=float(np.concatenate(self.same).mean()),
            ppl_source=float(np.exp(np.concatenate(nll_exact).astype(np.float64).mean())),
            ppl_output=float(np.exp(np.concatenate(self.nll).astype(np.float64).mean())),
        )


def measure(model, windows: list[list[int]], options: list[Option], skip: int = 0) -> dict[str, Quality]:
    """Each option's :class:`Quality` against the exact path, every window decoded a token a step and
    scored from its position ``skip`` on.

    Each path has its own KV cache; the paths step in lockstep, each step evaluated under its own
    settings (kernel settings apply to the products evaluated while they hold), so the exact
    distribution is compared at once and never stored for the whole text.
    """
    longest = max(len(w) for w in windows)
    exact = DecodePath(model, longest, EXACT.kv_cache_dtype)
    paths = [DecodePath(model, longest, o.kv_cache_dtype) for o in options]
    rows = [_Rows([], [], []) for _ in options]
    nll_exact: list[np.ndarray] = []
    for window in windows:
        for path in (exact, *paths):
            path.reset()
        steps: list[list[tuple[mx.array, ...]]] = [[] for _ in options]
        exact_nll = []
        for position, (token, target) in enumerate(zip(window[:-1], window[1:])):
            scored = position >= skip  # an unscored position still goes through: its K/V is context
            with applied(EXACT):
                lp_exact = exact.step(token)
                if scored:
                    exact_nll.append(-lp_exact[target])
                mx.eval(lp_exact, exact_nll)
            for option, path, figures in zip(options, paths, steps):
                with applied(option):
                    lp = path.step(token)
                    if not scored:
                        mx.eval(lp)
                        continue
                    # Clamped at 0: identical distributions can round to -1e-9; KL is never negative.
                    kl = mx.maximum(mx.sum(mx.exp(lp_exact) * (lp_exact - lp)), 0.0)
                    step = (kl, mx.argmax(lp_exact) == mx.argmax(lp), -lp[target])
                    mx.eval(step)  # here: only the three figures outlive the step, not lp
                figures.append(step)
        nll_exact.append(np.array(mx.stack(exact_nll)))
        for r, figures in zip(rows, steps):
            kl, same, nll = (np.array(mx.stack(column)) for column in zip(*figures))
            r.kl.append(kl)
            r.same.append(same)
            r.nll.append(nll)
    return {o.name: r.quality(nll_exact, len(windows)) for o, r in zip(options, rows)}


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    console = Console(width=None if sys.stdout.isatty() else 150)
    logging.basicConfig(level=logging.WARNING)
    try:
        lm = load(args.model)
        if args.chunk:
            windows = llama_chunks(lm.tokenizer, args.text, args.chunk, args.tokens)
        else:
            windows = eval_windows(lm.tokenizer, args.text, args.tokens)
    except MlxInferError as e:
        console.print(f"[red]error: {e}[/red]")
        return e.exit_code
    options = runnable(OPTIONS)
    console.print(f"{lm.weight_policy}; BLAS: {blas.active()}")
    results = measure(lm.model, windows, options, skip=args.chunk // 2 if args.chunk else 0)
    kernels = {o.name: _kernel(o) for o in options}

    llama: list[tuple[str, peers.LlamaQuality]] = []
    skipped = []
    if "llama.cpp" in args.compare:
        try:
            llama, why = _run_llama(lm.source, args)
        except (RuntimeError, OSError) as e:
            llama, why = [], f"failed: {e}"
        if not llama:
            skipped.append(f"llama.cpp: {why}")

    _print_table(console, results, kernels, llama, same_positions=bool(args.chunk))
    for line in skipped:
        console.print(f"[yellow]skipped {line}[/yellow]")
    if not options:
        console.print(f"[yellow]no lossy option runs here: {cpu_kernels.unavailable_reason()}[/yellow]")
    for name in (name for name, q in results.items() if q.kl_max == 0.0):
        console.print(f"{name}: identical to the exact path (lossless, or nothing in this model's weight "
                      "policy computes with it)")
    if args.json:
        _write_json(Path(args.json), args, results, kernels, llama, skipped)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", required=True, help="GGUF file, HF/MLX folder or Hub repo id")
    parser.add_argument("--text", type=Path, default=DEFAULT_EVAL_FILE,
                        help="evaluation text (default: convert/eval_text.txt)")
    parser.add_argument("--tokens", type=int, default=400, help="positions scored (default 400)")
    parser.add_argument("--chunk", type=int, default=0,
                        help="score as llama-perplexity -c CHUNK does (and run it so with --compare)")
    parser.add_argument("--compare", type=_peer_list, default=[], help="peers: llama.cpp")
    parser.add_argument("--llama-dir", help="folder of llama-perplexity and llama-quantize (default: PATH)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="llama.cpp threads")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    if args.tokens < 2:
        parser.error("--tokens must be at least 2")
    if args.chunk and args.chunk < 8:
        parser.error("--chunk must be at least 8")
    return args


def _peer_list(text: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    unknown = [x for x in names if x not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peer {', '.join(unknown)} (known: {', '.join(PEERS)})")
    return names


def llama_chunks(tokenizer, path: Path, ctx: int, scored: int) -> list[list[int]]:
    """The text cut as ``llama-perplexity -c ctx`` cuts it: the token stream (led by BOS if the model
    adds one) in chunks of ``ctx`` tokens, each chunk's first token replaced by BOS where there is one;
    as many chunks as score about ``scored`` positions, and as the text holds."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read evaluation text {path}: {e}") from None
    bos = tokenizer.encode("", add_special_tokens=True)
    stream = bos + tokenizer.encode(text, add_special_tokens=False)
    count = min(_chunk_count(ctx, scored), len(stream) // ctx)
    if count == 0:
        raise InvalidRequest(f"evaluation text {path} has fewer than --chunk {ctx} tokens")
    chunks = [stream[i * ctx : (i + 1) * ctx] for i in range(count)]
    return [bos + chunk[len(bos) :] for chunk in chunks]


def _chunk_count(ctx: int, scored: int) -> int:
    """Chunks of ``ctx`` tokens that score at least ``scored`` positions (the second half of each)."""
    return math.ceil(scored / (ctx - 1 - ctx // 2))


def _kernel(option: Option) -> str:
    with applied(option):
        return cpu_kernels.activations()


def _run_llama(gguf: str, args: argparse.Namespace) -> tuple[list[tuple[str, peers.LlamaQuality]], str]:
    """llama.cpp's (option, quality) rows, or none and why."""
    if not gguf.endswith(".gguf"):
        return [], "llama.cpp needs a .gguf model"
    tools = [peers.find_llama_tool(name, args.llama_dir) for name in ("llama-perplexity", "llama-quantize")]
    if None in tools:
        return [], "llama-perplexity/llama-quantize not found (put them on PATH or pass --llama-dir DIR)"
    ctx = args.chunk or LLAMA_CTX
    chunks = _chunk_count(ctx, args.tokens)
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as tmp:
        activations, kv = peers.run_llama_kld(*tools, gguf, args.text, ctx, chunks, args.threads, Path(tmp))
    return [("8-bit activations", activations), ("q8_0 KV (-ctk q8_0 -ctv q8_0)", kv)], ""


def _print_table(
    console: Console, results: dict[str, Quality], kernels: dict[str, str],
    llama: list[tuple[str, peers.LlamaQuality]], same_positions: bool,
) -> None:
    table = Table(title="quality against the exact path, teacher-forced, one token a step")
    for name in ("engine", "option", "kernel", "tokens", "mean KL", "p99 KL", "max KL", "top-1", "PPL exact",
                 "PPL option"):
        table.add_column(name, justify="left" if name in ("engine", "option", "kernel") else "right")
    for name, q in results.items():
        table.add_row("mlx-infer", name, kernels[name], str(q.tokens), f"{q.kl_mean:.4f}",
                      f"{q.kl_p99:.4f}", f"{q.kl_max:.4f}", f"{q.top1_agreement:.1%}", f"{q.ppl_source:.3f}",
                      f"{q.ppl_output:.3f}")
    for option, q in llama:
        table.add_row("llama.cpp", f"{option} (vs F32 GGUF, -c {q.ctx})", "", str(q.tokens),
                      f"{q.kl_mean:.4f}", f"{q.kl_p99:.4f}", f"{q.kl_max:.4f}", f"{q.same_top:.1%}",
                      f"{q.ppl_base:.3f}", f"{q.ppl:.3f}")
    console.print(table)
    console.print("KL(exact || option) in nats per position; top-1: the argmax tokens agree (llama.cpp: "
                  "'Same top p')")
    if llama and not same_positions:
        console.print("llama.cpp scored the second half of each chunk, mlx-infer every position from the "
                      "start: pass --chunk to score the same positions")


def _write_json(path: Path, args, results, kernels, llama, skipped: list[str]) -> None:
    data = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "blas": blas.active(),
                    "mlx": mx.__version__},
        "args": {"model": args.model, "text": str(args.text), "tokens": args.tokens, "compare": args.compare,
                 "chunk": args.chunk},
        "results": [dict(q.as_dict(), engine="mlx-infer", option=name, kernel=kernels[name])
                    for name, q in results.items()],
        "skipped": skipped,
    }
    data["results"] += [dict(vars(q), engine="llama.cpp", option=option) for option, q in llama]
    path.write_text(json.dumps(data, indent=2))


if __name__ == "__main__":
    sys.exit(main())
