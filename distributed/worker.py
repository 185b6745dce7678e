"""One rank of a distributed greedy/sampled generation: ``python -m mlx_infer.distributed.worker``.

Run by ``mlx-infer launch`` on every host (or alone, as a single process: the same code path without a
group). Rank 0 streams the answer to stdout; every rank ends with one ``RESULT {json}`` line (tokens, their
log-probabilities and timing on rank 0; on all of them the bytes this rank sent and how many of its layers
run as native block ops) that tests and measurements read.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from dataclasses import replace

import mlx.nn as nn

from mlx_infer import cli_options
from mlx_infer.engine.engine import Engine
from mlx_infer.errors import DistributedError, MlxInferError
from mlx_infer.models.native_block import NativeBlock
from mlx_infer.sampling import SamplingParams

from .runtime import STRATEGIES, init_group, open_session


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mlx_infer.distributed.worker", description=__doc__)
    cli_options.add_model_arguments(parser)
    parser.add_argument("--prompt", "-p", required=True)
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument(
        "--strategy",
        choices=STRATEGIES,
        default=None,
        help="default: $MLX_INFER_STRATEGY (set by launch), else pipeline",
    )
    parser.add_argument("--num-blocks", type=int, default=None, help="exact KV pool size (tests)")
    cli_options.add_sampling_arguments(parser)
    cli_options.add_engine_arguments(parser, max_num_seqs=1)
    return parser


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return _run(args)
    except MlxInferError as e:
        print(f"worker: error: {e}", file=sys.stderr)
        return e.exit_code
    except RuntimeError as e:  # the ring backend reports a lost peer as a RuntimeError
        print(f"worker: error: {e}", file=sys.stderr)
        return DistributedError.exit_code


def _run(args: argparse.Namespace) -> int:
    config = replace(cli_options.engine_config(args), num_blocks=args.num_blocks)
    cli_options.apply_cpu_activations(args)
    keep = args.keep_quantized
    group = init_group()
    if group is None:
        from mlx_infer.loading import load

        loaded = load(args.model, keep_quantized=keep)
        engine = Engine(loaded.model, loaded.tokenizer, loaded.max_context, config)
        _report(_generate(engine, args), rank=0, bytes_sent=0, messages=0, **_blocks(loaded.model))
        return 0
    session = open_session(args.model, group, config, args.strategy, keep)
    if session.rank != 0:
        session.follow()
        result = {"window_blocks": session.window_blocks}
    else:
        try:
            result = _generate(session.engine(), args)
        finally:
            session.close()
    traffic = session.shard.traffic
    _report(
        result, rank=session.rank, bytes_sent=traffic.bytes_sent, messages=traffic.messages,
        **_blocks(session.loaded.model),
    )
    return 0


def _generate(engine: Engine, args: argparse.Namespace) -> dict:
    tokenizer = engine.tokenizer
    if args.no_chat_template or not tokenizer.has_chat_template:
        prompt_ids = tokenizer.encode(args.prompt)
    else:
        prompt_ids = tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    # Each token's log-probability too: equal tokens can hide different logits.
    params: SamplingParams = replace(cli_options.sampling_params(args), logprobs=0)
    start = time.perf_counter()
    engine.add_request(prompt_ids, params)
    tokens, logprobs, times = [], [], []
    while engine.has_unfinished():
        for out in engine.step():
            tokens.extend(out.token_ids)
            logprobs.extend(lp.logprob for lp in out.logprobs or [])
            times.append(time.perf_counter())
            sys.stdout.write(out.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    decode = (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0
    return {
        "tokens": tokens,
        "logprobs": logprobs,
        "prompt_tokens": len(prompt_ids),
        "seconds": time.perf_counter() - start,
        "first_token_s": times[0] - start if times else None,
        "decode_tok_s": decode,
        "steps": engine.stats.steps,
        "window_blocks": None if engine.kv.window is None else engine.kv.window.pool.num_blocks,
    }


def _blocks(model: nn.Module) -> dict:
    """How many of this rank's layers run as native block ops (the CPU backend's fast path)."""
    native = sum(isinstance(block, NativeBlock) for block in model.layers)
    return {"layers": len(model.layers), "native_blocks": native}


def _report(result: dict, **fields) -> None:
    print("RESULT " + json.dumps({**fields, **result}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
