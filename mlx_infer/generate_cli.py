"""``mlx-infer generate``: one prompt (``--prompt``, ``-`` for stdin) or an interactive chat."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.text import Text

from mlx_infer import blas, cli_options, context_policy
from mlx_infer.chat import ChatSession, TurnStats
from mlx_infer.constraints import cli as constraint_cli
from mlx_infer.constraints import compile_constraint
from mlx_infer.errors import EngineFailure, InvalidRequest, MlxInferError, Terminated
from mlx_infer.terminal import StdoutConsole
from mlx_infer.tool_calls import Event, ReasoningDelta, TextDelta, ToolCallArgumentsDelta, ToolCallStart
from mlx_infer.tool_calls import cli as tool_cli
from mlx_infer.user_text import checked_text

HELP = (
    "commands: /reset (forget the conversation), /system [TEXT], /save FILE, /load FILE, /stats (toggle the "
    "stats line), /help, /exit; end a line with \\ to continue it, start it with // to send a message that "
    "begins with /; Ctrl-C stops an answer, twice at the prompt leaves"
)
SYSTEM_NEEDS_TEMPLATE = "--system needs the chat template (raw text has no system prompt)"
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
    tool_cli.add_tool_arguments(parser)
    cli_options.add_engine_arguments(parser, max_num_seqs=1)
    context_policy.add_argument(parser, default="truncate-oldest")


def run(args: argparse.Namespace) -> int:
    params = cli_options.sampling_params(args)  # checked: bad flags fail before the model loads
    params.constraint = constraint_cli.from_args(args)
    if args.tools is not None:
        tool_cli.read_tools(args.tools)  # its file too (each tool is checked against the template later)
    if args.system is not None and args.no_chat_template:
        raise InvalidRequest(SYSTEM_NEEDS_TEMPLATE)
    prompt = cli_options.stdin_prompt() if args.prompt == "-" else args.prompt
    if args.prompt == "-" and not prompt:
        raise InvalidRequest("-p -: nothing was piped in (an empty prompt)")
    if prompt is not None:
        checked_text(prompt, "the prompt")
    if args.system is not None:
        checked_text(args.system, "--system")
    with cli_options.open_engine(args) as opened:
        if opened is None:  # a follower rank under `mlx-infer launch`
            return 0
        loaded, engine = opened
        use_template = not args.no_chat_template and loaded.tokenizer.has_chat_template
        if args.system is not None and not use_template:  # (a model without a template, found now)
            raise InvalidRequest(SYSTEM_NEEDS_TEMPLATE)
        if not use_template and not args.no_chat_template and prompt is None:
            raise InvalidRequest("this model has no chat template; use --no-chat-template for raw text")
        plan = tool_cli.chat_plan(args, loaded.tokenizer) if use_template else None
        if plan is not None and plan.constraint is not None:
            if params.constraint is not None:
                raise InvalidRequest(
                    "a forced --tool-choice cannot be combined with --json-schema or --grammar"
                )
            params.constraint = plan.constraint
        if params.constraint is not None:
            compile_constraint(params.constraint, loaded.tokenizer)  # a bad schema fails before the chat
        err = Console(stderr=True, highlight=False)
        if args.verbose or prompt is None:
            err.print(
                f"[dim]{loaded.source}: {loaded.weight_policy}; BLAS: {blas.active()}[/dim]", soft_wrap=True
            )
        session = ChatSession(
            engine, params, args.system, use_template, context_overflow=args.context_overflow, plan=plan
        )
        if prompt is not None:
            return _one_shot(session, prompt, args.verbose, err)
        console = StdoutConsole(highlight=False)
        return _Chat(session, console, console if sys.stdin.isatty() else err).run()


def _one_shot(session: ChatSession, prompt: str, verbose: bool, err: Console) -> int:
    """The answer's text on stdout, its reasoning dimmed on stderr, and each tool call it makes as one
    JSON line ``{"name": ..., "arguments": ...}`` on stdout after the text."""
    stats = TurnStats()
    calls: list[dict] = []
    wrote_text = reasoned = False
    for event in session.reply(prompt, stats):
        if isinstance(event, TextDelta):
            if reasoned and not wrote_text:
                err.print()  # the reasoning's own line ends before the answer starts
            sys.stdout.write(event.text)
            sys.stdout.flush()
            wrote_text = True
        elif isinstance(event, ReasoningDelta):
            err.print(Text(event.text, style="dim"), end="")
            reasoned = True
        elif isinstance(event, ToolCallStart):
            calls.append({"name": event.name, "arguments": ""})
        else:
            calls[-1]["arguments"] += event.arguments
    if wrote_text or not calls:
        sys.stdout.write("\n")
    for call in calls:
        sys.stdout.write(
            json.dumps({"name": call["name"], "arguments": _json_or_text(call["arguments"])}) + "\n"
        )
    if verbose:
        err.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)
    return 0


def _json_or_text(arguments: str) -> object:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments  # a call cut off by max_tokens: shown as it came


class _AnswerPrinter:
    """Prints a streamed answer in the chat: reasoning dimmed, text as it comes, each tool call on a line
    of its own as ``-> name(arguments)``."""

    def __init__(self, console: Console):
        self.console = console
        self.kind: type | None = None  # the kind of the last event printed
        self.printed = False

    def __call__(self, event: Event) -> None:
        console = self.console
        if isinstance(event, ToolCallArgumentsDelta):
            console.print(Text(event.arguments, style="cyan"), end="")
            return
        self._close_call()
        if self.kind is not None and type(event) is not self.kind:
            console.print()  # reasoning, text and each call start a line of their own
        if isinstance(event, ReasoningDelta):
            console.print(Text(event.text, style="dim italic"), end="")
        elif isinstance(event, TextDelta):
            console.print(event.text, end="", markup=False)
        else:
            console.print(Text(f"-> {event.name}(", style="bold cyan"), end="")
        self.kind = type(event)
        self.printed = True

    def finish(self) -> None:
        self._close_call()

    def _close_call(self) -> None:
        if self.kind is ToolCallStart:
            self.console.print(Text(")", style="bold cyan"), end="")
            self.kind = ToolCallArgumentsDelta  # closed: the next event starts a new line


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
    """The interactive loop: a failing turn is reported in one line and dropped; the chat goes on.

    ``console`` gets the answers; ``notes`` the help, the prompts, the stats and the notices. They are the
    same terminal in a chat; with piped input they part, so stdout holds only the answers (as ``-p``), and
    a script learns from the exit status that a turn failed (the first failure's, as ``-p`` would exit)."""

    session: ChatSession
    console: Console
    notes: Console
    show_stats: bool = True
    failure: int = 0  # the exit status of the first turn that failed

    def run(self) -> int:
        _enable_line_editing()
        self.notes.print(f"[dim]{escape(HELP)}[/dim]")
        interrupted = False  # the last prompt ended with Ctrl-C
        while True:
            try:
                text = self._read_message()
            except EOFError:
                self.notes.print()
                return 0 if sys.stdin.isatty() else self.failure
            except Terminated:
                raise
            except KeyboardInterrupt:
                # Ctrl-C pressed a moment after an answer ended must not lose the conversation: a
                # second one in a row leaves (as a shell's interrupted command, 130).
                self.notes.print()
                if interrupted:
                    return 130
                self.notes.print("[dim](Ctrl-C again, Ctrl-D or /exit to leave)[/dim]")
                interrupted = True
                continue
            interrupted = False
            text = text.strip()
            if not text:
                continue
            if text.startswith("//"):
                text = text[1:]  # a message that begins with "/", not a command
            elif text.startswith("/"):
                if self._command(text):
                    return 0
                continue
            self._turn(text)

    def _read_message(self) -> str:
        """One message; a line ending in a backslash continues on the next."""
        lines = [self.notes.input(PROMPT)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            lines.append(self.notes.input(CONTINUATION))
        return "\n".join(lines)

    def _turn(self, text: str) -> None:
        console, notes = self.console, self.notes
        stats = TurnStats()
        printer = _AnswerPrinter(console)
        try:
            with _deferred_interrupt() as cancel:
                for event in self.session.reply(text, stats, cancel):
                    printer(event)
        except Terminated:
            raise  # SIGTERM: the chat ends, not the turn
        except KeyboardInterrupt:
            self._dropped("stopped", printer.printed)
            return
        except EngineFailure:
            raise  # the engine cannot run another step: the chat cannot go on
        except BrokenPipeError:
            raise  # stdout's reader went away: nobody reads another answer
        except MlxInferError as e:
            self._dropped(f"error: {e}", printer.printed)
            self.failure = self.failure or e.exit_code
            return
        except Exception as e:  # noqa: BLE001 - any failure costs this turn, never the conversation
            self._dropped(f"error: {type(e).__name__}: {e}", printer.printed)
            self.failure = self.failure or 1
            return
        printer.finish()
        console.print()
        if stats.dropped_turns:
            turns = "turn" if stats.dropped_turns == 1 else "turns"
            notes.print(
                f"[dim]({stats.dropped_turns} earlier {turns} left out to fit the context of "
                f"{stats.context} tokens)[/dim]"
            )
        if self.show_stats:
            notes.print(f"[dim]{stats.line()}[/dim]", soft_wrap=True)

    def _dropped(self, why: str, printed: bool) -> None:
        if printed:
            self.console.print()  # ends the answer's line
        self.notes.print(
            f"[yellow]({escape(why)}; turn dropped, the conversation is kept)[/yellow]", soft_wrap=True
        )

    def _command(self, text: str) -> bool:
        """Handle a /command; True means leave the chat."""
        session, console = self.session, self.notes
        name, _, rest = text.partition(" ")
        arg = rest.strip()
        if name in ("/exit", "/quit"):
            return True
        if name == "/reset":
            session.reset()
            console.print("[dim](conversation cleared)[/dim]")
        elif name == "/system":
            try:
                session.system = checked_text(arg, "the system prompt") or None
            except InvalidRequest as e:
                console.print(f"[red]{escape(str(e))}[/red] [dim](the system prompt is unchanged)[/dim]")
                return False
            session.reset()
            console.print(f"[dim](system prompt {'set' if arg else 'cleared'}; conversation cleared)[/dim]")
        elif name == "/stats":
            self.show_stats = not self.show_stats
            console.print(f"[dim](stats line {'on' if self.show_stats else 'off'})[/dim]")
        elif name in ("/save", "/load") and not arg:
            console.print(f"[red]usage: {name} FILE[/red]")
        elif name in ("/save", "/load"):
            try:
                if name == "/save":
                    session.save(arg)
                    console.print(f"[dim](saved to {escape(arg)})[/dim]", soft_wrap=True)
                else:
                    session.load(arg)
                    count = len(session.messages)
                    console.print(
                        f"[dim](loaded {count} message{'' if count == 1 else 's'} from {escape(arg)})[/dim]",
                        soft_wrap=True,
                    )
            except OSError as e:
                console.print(
                    f"[red]cannot {name[1:]} {escape(arg)}: {escape(str(e.strerror))}[/red]", soft_wrap=True
                )
            except MlxInferError as e:
                console.print(f"[red]cannot {name[1:]}: {escape(str(e))}[/red]", soft_wrap=True)
        elif name in ("/help", "/?"):
            console.print(f"[dim]{escape(HELP)}[/dim]")
        else:
            console.print(
                f"[red]unknown command {escape(name)}[/red] [dim](/help lists them; a message that begins "
                "with / is sent as //...)[/dim]",
                soft_wrap=True,
            )
        return False
