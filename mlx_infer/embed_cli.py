"""``mlx-infer embed``: embedding vectors of texts, one line each, or OpenAI-style JSON."""

from __future__ import annotations

import argparse
import json
import sys

from mlx_infer import cli_options, model_store
from mlx_infer.embedding import POOLING_MODES, load_embedding_model
from mlx_infer.errors import InvalidRequest
from mlx_infer.user_text import checked_text

MAX_BATCH_TOKENS = 4096  # padded tokens of one forward
MAX_BATCH_SIZE = 32  # inputs of one forward


def add_pooling_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--pooling",
        choices=POOLING_MODES,
        default=None,
        help="embed with this pooling (default: the sentence-transformers config's, else mean for an "
        "encoder; a decoder without one needs --pooling: embed refuses it, serve serves it for text); "
        "vectors are unit length unless a sentence-transformers config lacks a Normalize module",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser)
    parser.add_argument(
        "texts", nargs="*", metavar="TEXT", help="texts to embed; '-' reads one per line of stdin"
    )
    add_pooling_argument(parser)
    parser.add_argument(
        "--dimensions", type=int, default=None, help="keep the first N dimensions (Matryoshka-trained models)"
    )
    parser.add_argument("--json", action="store_true", help="print OpenAI's embeddings response body")


def _texts(args: argparse.Namespace) -> list[str]:
    texts: list[str] = []
    for text in args.texts:
        if text == "-":
            texts.extend(line for line in sys.stdin.read().splitlines() if line)
        else:
            texts.append(text)
    if not texts:
        raise InvalidRequest("no text to embed: give texts as arguments, or '-' to read them from stdin")
    return [checked_text(text, f"text {i + 1}") for i, text in enumerate(texts)]


def run(args: argparse.Namespace) -> int:
    if args.dimensions is not None and args.dimensions < 1:
        raise InvalidRequest(f"--dimensions must be positive, not {args.dimensions}")
    texts = _texts(args)  # before the model loads: a missing text fails at once
    model = load_embedding_model(args.model, pooling=args.pooling, keep_quantized=args.keep_quantized)
    model.check_dimensions(args.dimensions)
    inputs = model.tokenize(texts)
    model.check(inputs, param="text")
    vectors = model.resize(model.embed(inputs, MAX_BATCH_TOKENS, MAX_BATCH_SIZE), args.dimensions)
    if args.json:
        tokens = sum(len(ids) for ids in inputs)
        body = {
            "object": "list",
            "data": [
                {"object": "embedding", "index": i, "embedding": v.tolist()} for i, v in enumerate(vectors)
            ],
            "model": model_store.served_name(args.model),  # as serve names it
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }
        print(json.dumps(body))
    else:
        for v in vectors:
            print(" ".join(f"{x:.7g}" for x in v.tolist()))
    return 0
