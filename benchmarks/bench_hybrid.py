"""Decode tokens/s of a hybrid model (Gated DeltaNet + attention) against a same-size attention-only one.

    python benchmarks/bench_hybrid.py [--hidden 512] [--layers 8] [-p 128] [-n 64] [-r 3] [-b 1,4,16]
        [--json FILE]

Both models are random, built in-process at the same width and depth: ``qwen3`` (every layer paged
attention) and ``qwen3_5_text`` (three Gated DeltaNet layers per full-attention layer, as Qwen3.5), with
the same attention heads and a DeltaNet of the same width. Each run drives the engine the way ``serve``
does: ``b`` requests of a ``p``-token prompt, greedy, ``n`` tokens each; decode tok/s counts the tokens
emitted after every request's first, over the time they took; the two models' runs alternate and the
best of each is reported (this CPU is shared and noisy). The point (issue 20): the recurrent-state
path (slot reads and writes, the step recurrence) must not be what makes decoding slow.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

# mlx_infer first: it binds the optimized BLAS, which only works before mlx.core is imported.
import mlx_infer  # noqa: E402,F401,I001
import mlx.core as mx  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten  # noqa: E402

from mlx_infer import blas  # noqa: E402
from mlx_infer.engine.engine import Engine, EngineConfig  # noqa: E402
from mlx_infer.engine.scheduler import SchedulerConfig  # noqa: E402
from mlx_infer.loading.policy import prepare_for_backend  # noqa: E402
from mlx_infer.models import model_module  # noqa: E402
from mlx_infer.sampling import SamplingParams  # noqa: E402

VOCAB = 8192  # small, so the layers (not the head) make up most of a step


class _Tokenizer:
    """What the engine needs of a tokenizer, for token ids that are never shown."""

    vocab_size = VOCAB
    eos_token_ids: set[int] = set()
    bos_token_id = None

    class _Detok:
        def add(self, token: int) -> str:
            return ""

        def flush(self) -> str:
            return ""

    def detokenizer(self):
        return self._Detok()


def build(model_type: str, hidden: int, layers: int):
    heads = hidden // 64
    config = dict(
        model_type=model_type,
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=3 * hidden,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 4),
        head_dim=64,
        vocab_size=VOCAB,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    if model_type == "qwen3_5_text":
        config.update(
            full_attention_interval=4,
            linear_num_key_heads=heads // 2,
            linear_num_value_heads=heads,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_conv_kernel_dim=4,
        )
    module = model_module(model_type)
    mx.random.seed(0)
    model = module.Model(module.ModelArgs.from_dict(config))
    mx.eval(model.parameters())
    prepare_for_backend(model)  # as the loader leaves every model it loads
    return model


def decode_tok_s(model, batch: int, prompt: int, new: int) -> float:
    config = EngineConfig(
        kv_memory=0.5,
        kv_cache_dtype="auto",
        scheduler=SchedulerConfig(max_num_seqs=batch, max_num_batched_tokens=max(512, batch * prompt)),
    )
    engine = Engine(model, _Tokenizer(), 4096, config)
    rng = np.random.default_rng(batch)
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    for _ in range(batch):
        engine.add_request(rng.integers(1, VOCAB, prompt).tolist(), params)
    emitted: dict[str, int] = {}
    start = counted = 0
    while engine.has_unfinished():
        for out in engine.step():
            emitted[out.request_id] = emitted.get(out.request_id, 0) + len(out.token_ids)
        if not start and len(emitted) == batch and all(emitted.values()):
            start, counted = time.perf_counter(), sum(emitted.values())
    return (sum(emitted.values()) - counted) / (time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("-p", type=int, default=128, help="prompt tokens")
    parser.add_argument("-n", type=int, default=64, help="tokens generated per request")
    parser.add_argument("-r", type=int, default=3, help="repetitions (the best is reported)")
    parser.add_argument("-b", default="1,4,16", help="batch sizes")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.b.split(",")]
    models = {t: build(t, args.hidden, args.layers) for t in ("qwen3", "qwen3_5_text")}
    results = []
    for b in batches:
        runs: dict[str, list[float]] = {t: [] for t in models}
        for _ in range(args.r):  # alternating, so a noisy moment of the machine hits both alike
            for t, model in models.items():
                runs[t].append(decode_tok_s(model, b, args.p, args.n))
        for t, model in models.items():
            params = sum(v.size for _, v in tree_flatten(model.parameters()))
            results.append(
                dict(model_type=t, parameters=params, batch=b, decode_tok_s=max(runs[t]), runs=runs[t])
            )
            each = ", ".join(f"{x:.1f}" for x in runs[t])
            print(f"{t:13s} batch {b:3d}: decode {max(runs[t]):7.1f} tok/s  (runs {each})", flush=True)
    by = {(r["model_type"], r["batch"]): r["decode_tok_s"] for r in results}
    for b in batches:
        print(f"batch {b}: hybrid / attention-only = {by['qwen3_5_text', b] / by['qwen3', b]:.2f}")
    data = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "blas": blas.active(),
            "device": str(mx.default_device()),
        },
        "args": vars(args) | {"json": str(args.json) if args.json else None},
        "results": results,
    }
    if args.json:
        args.json.write_text(json.dumps(data, indent=2))
    else:
        print(json.dumps(data, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
