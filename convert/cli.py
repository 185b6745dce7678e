"""``mlx-infer convert``: arguments and entry point.

``mlx_infer.cli`` wires ``add_arguments`` and ``run`` in as the ``convert`` subcommand and turns the typed
errors ``run`` raises into one line and an exit code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .pipeline import DTYPES, Options, convert
from .quant import MODES, RECIPES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    # No argparse ``choices`` for the quantization options: ``run`` validates them (and their
    # combinations) and raises a typed error, so bad values fail in one line like every other error.
    parser.add_argument(
        "--model", "-m", required=True, help="Hugging Face / MLX folder, Hub repo id or .gguf file"
    )
    parser.add_argument("--out", required=True, type=Path, help="output folder (refused if it exists)")
    parser.add_argument("--q-bits", type=int,
                        help="affine 2,3,4,5,6,8; mxfp4/nvfp4 4; mxfp8 8 (default when quantizing: 4, 8 "
                        "for mxfp8; with no --q-*, --recipe or --pure nothing is re-quantized)")
    parser.add_argument("--q-group-size", type=int,
                        help="affine 32,64,128 (default: the source's, else 64); mx* 32; nvfp4 16")
    parser.add_argument("--q-mode", help=f"quantization mode: {', '.join(MODES)} (default affine)")
    parser.add_argument("--recipe", help=f"mixed precision, Q4_K_M style: {', '.join(RECIPES)}")
    parser.add_argument("--dtype", help=f"floating-point weights and scales: {', '.join(DTYPES)} "
                                        "(default: the config's torch_dtype, else the source's)")
    parser.add_argument("--dequantize", action="store_true",
                        help="write every layer in floating point (not with --q-*, --recipe or --pure)")
    parser.add_argument("--pure", action="store_true",
                        help="every layer at the requested bits, also those the source keeps at more (lossy)")
    parser.add_argument("--force", action="store_true", help="replace an existing output folder")
    parser.add_argument("--eval-file", type=Path, help="text to measure quality on (default: shipped prose)")
    parser.add_argument("--eval-tokens", type=int, default=1024, help="tokens of it to use (default 1024)")
    parser.add_argument("--no-eval", action="store_true", help="skip the quality report's evaluation")


def run(args: argparse.Namespace) -> int:
    try:
        _convert(args)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM (Terminated): the output folder is moved in place last
        print(f"interrupted: nothing was written to {args.out}", file=sys.stderr)
        raise
    return 0


def _convert(args: argparse.Namespace) -> None:
    convert(Options(
        model=args.model, out=args.out, q_bits=args.q_bits, q_group_size=args.q_group_size,
        q_mode=args.q_mode, recipe=args.recipe, dtype=args.dtype, dequantize=args.dequantize, pure=args.pure,
        force=args.force, eval_file=args.eval_file, eval_tokens=args.eval_tokens, no_eval=args.no_eval,
    ))
