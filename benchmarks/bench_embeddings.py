"""Embedding throughput (inputs/s, tokens/s) of mlx-infer, with sentence-transformers beside it.

    python benchmarks/bench_embeddings.py -m MODEL_FOLDER [-b 1,32] [-n 256] [-r 3]
        [--compare sentence-transformers] [--st-python /tmp/oracle-venv/bin/python] [--json FILE]

Both engines embed the same texts (word windows of 8-40 words cut from the prose ``convert`` evaluates
on), all at once per repetition with at most B inputs per forward: each sorts the inputs by length first
(``EmbeddingModel.embed``, ``SentenceTransformer.encode``), so batch 1 is every input alone and batch 32
pads each forward to its longest input. sentence-transformers runs in its own interpreter (torch is no
dependency of mlx-infer); token counts are mlx-infer's, which equal the Hugging Face tokenizer's.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import mlx_infer  # noqa: F401  (binds the optimized BLAS before mlx.core loads)
from mlx_infer import blas
from mlx_infer.embedding import load_embedding_model

TEXT = Path(__file__).resolve().parents[1] / "convert" / "eval_text.txt"

# Runs in the sentence-transformers interpreter: argv = folder, texts JSON, batches, repeats.
_ST_CHILD = r"""
import json, sys, time
import torch
from sentence_transformers import SentenceTransformer
folder, texts_file, batches, repeats = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
texts = json.load(open(texts_file))
model = SentenceTransformer(folder, device="cpu")
model.encode(texts[:8], batch_size=8)
out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "times": {}}
for b in map(int, batches.split(",")):
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        model.encode(texts, batch_size=b, convert_to_numpy=True)
        times.append(time.perf_counter() - start)
    out["times"][b] = times
print(json.dumps(out))
"""


def texts(count: int) -> list[str]:
    """``count`` deterministic word windows of 8-40 words."""
    words = TEXT.read_text(encoding="utf-8").split()
    out = []
    for i in range(count):
        length = 8 + (i * 13) % 33
        start = (i * 37) % (len(words) - length)
        out.append(" ".join(words[start : start + length]))
    return out


def row(engine: str, batch: int, times: list[float], inputs: int, tokens: int, note: str) -> dict:
    best, mean = min(times), statistics.fmean(times)
    return {
        "engine": engine,
        "batch": batch,
        "inputs": inputs,
        "tokens": tokens,
        "seconds": times,
        "inputs_per_s": inputs / mean,
        "tokens_per_s": tokens / mean,
        "inputs_per_s_best": inputs / best,
        "note": note,
    }


def run_mlx_infer(folder: str, inputs: list[list[int]], batches: list[int], repeats: int) -> list[dict]:
    model = load_embedding_model(folder)
    tokens = sum(len(ids) for ids in inputs)
    model.embed(inputs[:8], 1 << 30, 8)  # warm-up: first-call allocations and kernel setup
    rows = []
    for b in batches:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            model.embed(inputs, 1 << 30, b)
            times.append(time.perf_counter() - start)
        rows.append(row("mlx-infer", b, times, len(inputs), tokens, f"BLAS: {blas.active()}"))
    return rows


def run_sentence_transformers(
    python: str, folder: str, text_list: list[str], tokens: int, batches: list[int], repeats: int
) -> list[dict]:
    texts_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_embeddings_{os.getpid()}.json"
    texts_file.write_text(json.dumps(text_list))
    try:
        done = subprocess.run(
            [python, "-c", _ST_CHILD, folder, str(texts_file), ",".join(map(str, batches)), str(repeats)],
            capture_output=True,
            text=True,
            check=True,
            timeout=1800,
        )
    finally:
        texts_file.unlink(missing_ok=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    note = f"torch {out['torch']}, {out['threads']} threads"
    return [
        row("sentence-transformers", b, out["times"][str(b)], len(text_list), tokens, note) for b in batches
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "-m", "--model", required=True, help="a sentence-transformers folder (e.g. all-MiniLM-L6-v2)"
    )
    p.add_argument(
        "-b", "--batch", default="1,32", help="inputs per forward, comma-separated (default: 1,32)"
    )
    p.add_argument("-n", "--num-inputs", type=int, default=256, help="texts per repetition (default: 256)")
    p.add_argument("-r", "--repeats", type=int, default=3, help="repetitions (default: 3)")
    p.add_argument("--compare", default="", help="sentence-transformers: run it on the same texts")
    p.add_argument("--st-python", default="/tmp/oracle-venv/bin/python", help="interpreter with it installed")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the rows as JSON")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    batches = [int(b) for b in args.batch.split(",")]

    text_list = texts(args.num_inputs)
    model = load_embedding_model(args.model)
    inputs = model.tokenize(text_list)
    tokens = sum(len(ids) for ids in inputs)
    del model
    rows = run_mlx_infer(args.model, inputs, batches, args.repeats)
    if "sentence-transformers" in args.compare:
        rows += run_sentence_transformers(
            args.st_python, args.model, text_list, tokens, batches, args.repeats
        )

    print(
        f"{len(inputs)} inputs, {tokens} tokens ({tokens / len(inputs):.1f} per input), {platform.machine()}"
    )
    print(f"{'engine':<22} {'batch':>5} {'inputs/s':>9} {'tokens/s':>9}  note")
    for r in rows:
        rate = f"{r['inputs_per_s']:>9.1f} {r['tokens_per_s']:>9.0f}"
        print(f"{r['engine']:<22} {r['batch']:>5} {rate}  {r['note']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
