"""``mlx-infer generate``: one prompt (``--prompt``, ``-`` for stdin) or an interactive chat."""

from __future__ import annotations

import argparse
import sys

from rich.console import Console

from mlx_infer import blas, cli_options
from mlx_infer.chat import ChatSession, TurnStats
from mlx_infer.errors import InvalidRequest

HELP = "commands: /reset (forget the conversation), /system TEXT, /save FILE, /exit; Ctrl-C stops an answer"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser)
    parser.add_argument("--prompt", "-p", default=None, help="answer this prompt and exit ('-' reads stdin)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="print the stats line in one-shot mode too"
    )
    cli_options.add_sampling_arguments(parser)
    cli_options.add_engine_arguments(parser, max_num_seqs=1)


def run(args: argparse.Namespace) -> int:
    params = cli_options.sampling_params(args)
    params.validate()  # before the model loads: bad flags fail at once
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with cli_options.open_engine(args) as opened:
        if opened is None:  # a follower rank under `mlx-infer launch`
            return 0
        loaded, engine = opened
        err = Console(stderr=True, highlight=False)
        if args.verbose or prompt is None:
            err.print(
                f"[dim]{loaded.source}: {loaded.weight_policy}; BLAS: {blas.active()}[/dim]", soft_wrap=True
            )
        use_template = not args.no_chat_template and loaded.tokenizer.has_chat_template
        if not use_template and not args.no_chat_template and prompt is None:
            raise InvalidRequest("this model has no chat template; use --no-chat-template for raw text")
        session = ChatSession(engine, params, args.system, use_template)
        if prompt is not None:
            return _one_shot(session, prompt, args.verbose, err)
        return _interactive(session, err)


def _one_shot(session: ChatSession, prompt: str, verbose: bool, err: Console) -> int:
    stats = TurnStats()
    for delta in session.reply(prompt, stats):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if verbose:
        err.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)
    return 0


def _interactive(session: ChatSession, err: Console) -> int:
    console = Console(highlight=False)
    console.print(f"[dim]{HELP}[/dim]")
    while True:
        try:
            text = console.input("[bold green]>>> [/bold green]")
        except (EOFError, KeyboardInterrupt):
            console.print()
            return 0
        text = text.strip()
        if not text:
            continue
        if text.startswith("/"):
            if _command(session, text, console):
                return 0
            continue
        stats = TurnStats()
        try:
            for delta in session.reply(text, stats):
                console.print(delta, end="", markup=False)
        except KeyboardInterrupt:
            console.print("\n[yellow](stopped)[/yellow]", end="")
        console.print()
        console.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)


def _command(session: ChatSession, text: str, console: Console) -> bool:
    """Handle a /command; True means leave the chat."""
    name, _, rest = text.partition(" ")
    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        session.reset()
        console.print("[dim](conversation cleared)[/dim]")
    elif name == "/system":
        session.system = rest.strip() or None
        session.reset()
        console.print("[dim](system prompt set; conversation cleared)[/dim]")
    elif name == "/save" and rest.strip():
        try:
            session.save(rest.strip())
            console.print(f"[dim](saved to {rest.strip()})[/dim]")
        except OSError as e:
            console.print(f"[red]cannot save: {e.strerror}[/red]")
    else:
        console.print(f"[dim]{HELP}[/dim]")
    return False
