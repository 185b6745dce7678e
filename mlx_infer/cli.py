"""``mlx-infer`` command line: one subcommand per job, typed errors turned into one line and an exit code."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
import sys
import threading
from importlib.metadata import PackageNotFoundError, version

from mlx_infer.errors import MlxInferError, Terminated

# subcommand -> (module with add_arguments(parser) and run(args) -> int, help)
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("mlx_infer.generate_cli", "chat with a model in the terminal, or answer one prompt"),
    "embed": ("mlx_infer.embed_cli", "print embedding vectors of texts (an embedding model)"),
    "serve": ("mlx_infer.server.cli", "serve an OpenAI-compatible API with continuous batching"),
    "convert": ("mlx_infer.convert.cli", "convert and quantize a checkpoint, with a quality report"),
    "models": ("mlx_infer.models_cli", "list the models on this machine: size, architecture, quantization"),
    "plan": ("mlx_infer.plan_cli", "will a model fit: weights, KV cache and decode bound from its metadata"),
    "pull": ("mlx_infer.pull_cli", "download a model from the Hugging Face Hub (resumable)"),
    "rm": ("mlx_infer.rm_cli", "delete a model from the Hugging Face cache or mlx-infer's cache"),
    "launch": ("mlx_infer.distributed.launch", "run generate or serve across hosts, one rank each"),
    "hosts": ("mlx_infer.distributed.hosts", "check hosts for launch: reachability and interfaces"),
}


def _version() -> str:
    try:
        return version("mlx-infer")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """A bad argument is one line (the usage block is what --help is for), as every other error is."""

    def __init__(self, *args, **kwargs):
        # A flag is taken only as spelled: a prefix (--json for --json-schema) is an unknown flag.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="mlx-infer", description="LLM inference on MLX.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=help_text, description=help_text)
        importlib.import_module(module).add_arguments(sub_parser)
        sub_parser.set_defaults(_module=module, _parser=sub_parser)
    return parser


def _terminated(signum, frame) -> None:
    raise Terminated


def _stopped_status(error: KeyboardInterrupt, argv: list[str]) -> int:
    """Ctrl-C: 130. SIGTERM: 143, but for ``serve``, whose SIGTERM is its normal stop (0) however early
    it comes (before the server runs: while Python imports, the arguments are read, the model opens)."""
    if not isinstance(error, Terminated):
        return 130
    return 0 if argv[:1] == ["serve"] else 143


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    argv = sys.argv[1:] if argv is None else argv
    # SIGTERM (a supervisor, `kill`) cleans up as Ctrl-C does: a half-written convert output is removed,
    # a request aborted. Commands with their own handling (serve's server, launch) replace this one.
    if threading.current_thread() is threading.main_thread():  # (main called from a test's thread)
        signal.signal(signal.SIGTERM, _terminated)
    try:  # building the parser imports every subcommand (MLX among them): seconds a signal can land in
        args, unknown = build_parser().parse_known_args(argv)
    except KeyboardInterrupt as e:
        return _stopped_status(e, argv)
    if unknown:  # named by the subcommand they were given to, not by the top-level parser
        args._parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return importlib.import_module(args._module).run(args)
    except MlxInferError as e:
        print(f"mlx-infer {args.command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt as e:
        return _stopped_status(e, argv)
    except BrokenPipeError:
        # The reader went away (`| head`): stop quietly as a Unix filter does, and keep Python's flush
        # of stdout at exit from failing again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a filter the pipe stopped
    except Exception as e:  # noqa: BLE001 - the last line of defence: one line, not a traceback
        if os.environ.get("MLX_INFER_DEBUG"):
            raise
        print(
            f"mlx-infer {args.command}: internal error: {type(e).__name__}: {e} "
            "(set MLX_INFER_DEBUG=1 for the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())
