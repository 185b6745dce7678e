"""``mlx-infer generate``: one prompt (``--prompt``, ``-`` for stdin) or an interactive chat."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape

from mlx_infer import blas, cli_options, context_policy
from mlx_infer.chat import ChatSession, TurnStats
from mlx_infer.constraints import cli as constraint_cli
from mlx_infer.constraints import compile_constraint
from mlx_infer.errors import EngineFailure, InvalidRequest, MlxInferError

HELP = (
    "commands: /reset (forget the conversation), /system TEXT, /save FILE, /load FILE, /stats (toggle the "
    "stats line), /exit; end a line with \\ to continue it; Ctrl-C stops an answer"
)
PROMPT = "[bold green]>>> [/bold green]"
CONTINUATION = "[bold green]... [/bold green]"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cli_options.add_model_arguments(parser)
    parser.add_argument("--prompt", "-p", default=None, help="answer this prompt and exit ('-' reads stdin)")
    parser.add_argument("--system", default=None, help="system prompt")
    parser.add_argument("--no-chat-template", action="store_true", help="send the prompt as raw text")
    parser.add_argument(
        "--verbose", "-v", action="store_true", help="print the stats line in one-shot mode too"
    )
    cli_options.add_sampling_arguments(parser)
    constraint_cli.add_arguments(parser)
    cli_options.add_engine_arguments(parser, max_num_seqs=1)
    context_policy.add_argument(parser, default="truncate-oldest")


def run(args: argparse.Namespace) -> int:
    params = cli_options.sampling_params(args)
    params.constraint = constraint_cli.from_args(args)
    params.validate()  # before the model loads: bad flags fail at once
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    with cli_options.open_engine(args) as opened:
        if opened is None:  # a follower rank under `mlx-infer launch`
            return 0
        loaded, engine = opened
        if params.constraint is not None:
            compile_constraint(params.constraint, loaded.tokenizer)  # a bad schema fails before the chat
        err = Console(stderr=True, highlight=False)
        if args.verbose or prompt is None:
            err.print(
                f"[dim]{loaded.source}: {loaded.weight_policy}; BLAS: {blas.active()}[/dim]", soft_wrap=True
            )
        use_template = not args.no_chat_template and loaded.tokenizer.has_chat_template
        if not use_template and not args.no_chat_template and prompt is None:
            raise InvalidRequest("this model has no chat template; use --no-chat-template for raw text")
        session = ChatSession(
            engine, params, args.system, use_template, context_overflow=args.context_overflow
        )
        if prompt is not None:
            return _one_shot(session, prompt, args.verbose, err)
        return _Chat(session, Console(highlight=False)).run()


def _one_shot(session: ChatSession, prompt: str, verbose: bool, err: Console) -> int:
    stats = TurnStats()
    for delta in session.reply(prompt, stats):
        sys.stdout.write(delta)
        sys.stdout.flush()
    sys.stdout.write("\n")
    if verbose:
        err.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)
    return 0


@contextlib.contextmanager
def _deferred_interrupt() -> Iterator[threading.Event]:
    """Ctrl-C sets an event instead of raising wherever Python happens to be (possibly inside an engine
    step, leaving it half done); the turn checks the event between steps."""
    cancel = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda signum, frame: cancel.set())
    try:
        yield cancel
    finally:
        signal.signal(signal.SIGINT, previous)


def _enable_line_editing() -> None:
    """Load readline where there is one: input() then edits lines, keeps a history and takes a
    bracketed paste of several lines as one message."""
    if sys.stdin.isatty():
        with contextlib.suppress(ImportError):
            import readline  # noqa: F401 - importing it is what hooks it into input()


@dataclass
class _Chat:
    """The interactive loop: a failing turn is reported in one line and dropped; the chat goes on."""

    session: ChatSession
    console: Console
    show_stats: bool = True

    def run(self) -> int:
        _enable_line_editing()
        self.console.print(f"[dim]{escape(HELP)}[/dim]")
        while True:
            try:
                text = self._read_message()
            except (EOFError, KeyboardInterrupt):
                self.console.print()
                return 0
            text = text.strip()
            if not text:
                continue
            if text.startswith("/"):
                if self._command(text):
                    return 0
                continue
            self._turn(text)

    def _read_message(self) -> str:
        """One message; a line ending in a backslash continues on the next."""
        lines = [self.console.input(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self.console.input(CONTINUATION))
        return "\n".join(lines)

    def _turn(self, text: str) -> None:
        console = self.console
        stats = TurnStats()
        printed = False
        try:
            with _deferred_interrupt() as cancel:
                for delta in self.session.reply(text, stats, cancel):
                    console.print(delta, end="", markup=False)
                    printed = True
        except KeyboardInterrupt:
            self._dropped("stopped", printed)
            return
        except EngineFailure:
            raise  # the engine cannot run another step: the chat cannot go on
        except MlxInferError as e:
            self._dropped(f"error: {e}", printed)
            return
        except Exception as e:  # noqa: BLE001 - any failure costs this turn, never the conversation
            self._dropped(f"error: {type(e).__name__}: {e}", printed)
            return
        console.print()
        if stats.dropped_turns:
            turns = "turn" if stats.dropped_turns == 1 else "turns"
            console.print(
                f"[dim]({stats.dropped_turns} earlier {turns} left out to fit the context of "
                f"{stats.context} tokens)[/dim]"
            )
        if self.show_stats:
            console.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)

    def _dropped(self, why: str, printed: bool) -> None:
        if printed:
            self.console.print()
        self.console.print(
            f"[yellow]({escape(why)}; turn dropped, the conversation is kept)[/yellow]", soft_wrap=True
        )

    def _command(self, text: str) -> bool:
        """Handle a /command; True means leave the chat."""
        session, console = self.session, self.console
        name, _, rest = text.partition(" ")
        arg = rest.strip()
        if name in ("/exit", "/quit"):
            return True
        if name == "/reset":
            session.reset()
            console.print("[dim](conversation cleared)[/dim]")
        elif name == "/system":
            session.system = arg or None
            session.reset()
            console.print("[dim](system prompt set; conversation cleared)[/dim]")
        elif name == "/stats":
            self.show_stats = not self.show_stats
            console.print(f"[dim](stats line {'on' if self.show_stats else 'off'})[/dim]")
        elif name in ("/save", "/load") and arg:
            try:
                if name == "/save":
                    session.save(arg)
                    console.print(f"[dim](saved to {escape(arg)})[/dim]", soft_wrap=True)
                else:
                    session.load(arg)
                    console.print(
                        f"[dim](loaded {len(session.messages)} messages from {escape(arg)})[/dim]",
                        soft_wrap=True,
                    )
            except OSError as e:
                console.print(
                    f"[red]cannot {name[1:]} {escape(arg)}: {escape(str(e.strerror))}[/red]", soft_wrap=True
                )
            except MlxInferError as e:
                console.print(f"[red]cannot load: {escape(str(e))}[/red]", soft_wrap=True)
        else:
            console.print(f"[dim]{escape(HELP)}[/dim]")
        return False
